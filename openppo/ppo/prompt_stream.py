"""The order in which prompts reach the RL step, and the data position a checkpoint stores.

Every episode is a fresh random permutation of the prompt set, seeded by `(seed, episode)` alone, so a resumed
run rebuilds the same order without replaying earlier episodes. Each episode uses a whole number of rollout
batches (the remainder of a permutation is skipped, as a `drop_last` loader would). The only state is the cursor:
how many prompts have been handed out. Dynamic filtering takes more prompts per step than the batch holds, so
steps and prompts are counted apart.
"""

from __future__ import annotations

import torch


class PromptStream:
    def __init__(self, num_prompts: int, *, rollout_batch_size: int, num_episodes: int, seed: int):
        if num_prompts < rollout_batch_size:
            raise ValueError(f"{num_prompts} prompts do not fill one rollout batch of {rollout_batch_size}")
        self.num_prompts = num_prompts
        self.per_episode = (num_prompts // rollout_batch_size) * rollout_batch_size
        self.num_episodes = num_episodes
        self.seed = seed
        self.cursor = 0
        self._orders: dict[int, list[int]] = {}

    @property
    def total(self) -> int:
        return self.per_episode * self.num_episodes

    @property
    def episode(self) -> int:
        return self.cursor // self.per_episode

    def remaining(self) -> int:
        return self.total - self.cursor

    def _order(self, episode: int) -> list[int]:
        if episode not in self._orders:
            self._orders = {
                episode: torch.randperm(
                    self.num_prompts, generator=torch.Generator().manual_seed(self.seed * 100_003 + episode)
                ).tolist()
            }
        return self._orders[episode]

    def take(self, n: int) -> list[int]:
        """The next `n` prompt indices (fewer, possibly none, when the episodes are used up)."""
        out = []
        while len(out) < n and self.cursor < self.total:
            episode, offset = divmod(self.cursor, self.per_episode)
            out.append(self._order(episode)[offset])
            self.cursor += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self.cursor, "per_episode": self.per_episode}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["per_episode"] != self.per_episode:
            raise ValueError(
                f"the checkpoint was taken with {state['per_episode']} prompts per episode, this run has "
                f"{self.per_episode}: resume with the same --prompt_data, --max_samples and "
                f"--rollout_batch_size"
            )
        self.cursor = int(state["cursor"])
