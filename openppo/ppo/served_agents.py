"""--agent_program: a rollout source whose episodes are played by the user's OpenAI-speaking agent against the run's
own endpoint (`openppo.agents.endpoint`), and the scorer that goes with it.

Each rollout round gives every episode (n per prompt) a session and runs the agents, at most --agent_concurrency at
once, each within --agent_timeout. The endpoint serves their calls from the engine pool (batched as they arrive, at the
run's sampling settings) and records every call. When an episode ends its transcript becomes the sample: one training
row per segment (`Transcript`: a call whose prompt does not extend what came before seals the segment), each row
trained on exactly the tokens the engine generated, with the engine's log-probs and weight version. The episode's
reward is what its agent returned, or the reward function's / reward model's score of the task prompt and the last
answer when it returned None.

An episode whose agent failed (raised, exited non-zero, ran out of time) or made no call is dropped: its traceback or
reason goes to the log (in full for the first of a round), and its whole group leaves the batch (a group-normalised
advantage needs all n episodes), which the collector refills with new prompts as dynamic filtering does.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from openppo.agents.endpoint import Batcher, EndpointServer, Generated, Sessions, create_app, tool_parser_factory
from openppo.agents.program import AgentProgram, Outcome
from openppo.agents.transcript import Transcript
from openppo.ppo.collector import RolloutSource, Scorer, SingleTurn, mean_extra
from openppo.rollout.pool import Sample

logger = logging.getLogger(__name__)


class ServedAgents(RolloutSource):
    """Episodes of an --agent_program through the endpoint; also the run's scorer (module doc)."""

    drops_episodes = True

    def __init__(self, turns: SingleTurn, program: AgentProgram, tokenizer, fallback: Scorer | None):
        super().__init__(turns.cfg)
        self.turns, self.program, self.tokenizer, self.fallback = turns, program, tokenizer, fallback
        self._version = 0
        self._lock = threading.Lock()
        self._playing = 0  # the round's episodes not finished: each may send a request (`Batcher`)
        self.server: EndpointServer | None = None
        self.sessions = Sessions()

    @property
    def model_name(self) -> str:
        return self.cfg.model.pretrain

    def start(self) -> str:
        """Serve the endpoint (once); returns its base URL."""
        if self.server is None:
            r, d = self.cfg.rollout, self.cfg.data
            parser = tool_parser_factory(r.agent_tool_parser, self.tokenizer) if r.agent_tool_parser else None
            self._batcher = Batcher(self._generate_batch, expected=self._expected_requests)
            app = create_app(
                self._batcher,
                self.tokenizer,
                self.sessions,
                model_name=self.model_name,
                max_tokens_limit=d.generate_max_len,
                timeout_s=self.turns.engines.timeout_s,
                sampling={"temperature": r.temperature, "top_p": r.top_p},
                max_context=d.total_len(),
                tool_parser=parser,
                weight_version=lambda: self.turns.engines.version,
            )
            self.server = EndpointServer(app, host=r.agent_host)
            logger.info("agent endpoint serving %s at %s", self.model_name, self.server.base_url)
        return self.server.base_url

    def _expected_requests(self) -> int:
        """The episodes that can send a request now: those not finished, at most --agent_concurrency of them."""
        return min(self._playing, self.cfg.rollout.agent_concurrency or self._playing)

    def close(self) -> None:
        """Stop the server and its batcher (the run is over)."""
        if self.server is not None:
            self.server.stop()
            self._batcher.stop()
            self.server = None

    def _generate_batch(self, prompts: list[list[int]], params: dict[str, Any]) -> list[Generated]:
        """One batch of the endpoint's requests on the pool, at the run's sampling settings."""
        items = [{"prompt_ids": ids, "index": i} for i, ids in enumerate(prompts)]
        samples = self.turns.generate(
            items,
            n=1,
            temperature=self.cfg.rollout.temperature,
            seed=None,
            version=self._version,
            max_new_tokens=[params["max_new_tokens"]] * len(prompts),
        )
        return [Generated(s.response_ids, s.rollout_log_probs, s.finish_reason, s.policy_version) for s in samples]

    def generate(
        self, items: list[dict], *, n: int, temperature: float, seed: int | None, version: int
    ) -> list[Sample]:
        base = self.start()
        self._version = version
        r = self.cfg.rollout
        round_id = uuid.uuid4().hex[:12]
        episodes = [(item, k, f"{round_id}-{j * n + k}") for j, item in enumerate(items) for k in range(n)]

        def play(episode) -> Outcome:
            item, k, session = episode
            task = {
                "prompt": item["prompt"],
                "messages": item.get("messages"),
                "tools": item.get("tools"),
                "label": item.get("label"),
                "index": item["index"],
                "sample": k,
                "session": session,
            }
            try:
                return self.program.run(f"{base.removesuffix('/v1')}/sessions/{session}/v1", task, r.agent_timeout)
            finally:
                with self._lock:
                    self._playing -= 1

        self._playing = len(episodes)  # (set before any starts: the first request waits for the others)
        with ThreadPoolExecutor(max_workers=r.agent_concurrency or len(episodes)) as pool:
            outcomes = list(pool.map(play, episodes))
        samples = [
            self._sample(item, self.sessions.close(session), outcome, version)
            for (item, _, session), outcome in zip(episodes, outcomes)
        ]
        self._log_dropped([(s, session) for s, (_, _, session) in zip(samples, episodes) if s.dropped])
        return samples

    def _sample(self, item: dict, transcript: Transcript, outcome: Outcome, version: int) -> Sample:
        base = dict(group=item["index"], label=item.get("label"), prompt_text=item["prompt"])
        last = transcript.last
        if outcome.error is None and last is None:
            outcome = Outcome(error="the agent made no call to the endpoint")
        if outcome.error is not None:
            return Sample(list(item["prompt_ids"]), [], [], "stop", dropped=outcome.error, **base)
        rows = [
            Sample(
                prompt_ids=segment.prompt_ids,
                response_ids=segment.response_ids,
                rollout_log_probs=segment.log_probs,
                finish_reason=segment.finish_reason,
                action_mask=segment.action_mask,
                policy_version=min(segment.versions, default=version),
                token_versions=list(segment.versions),
                **base,
            )
            for segment in transcript.segments
        ]
        return Sample(
            prompt_ids=list(last.prompt_ids),
            response_ids=list(last.output_ids),
            rollout_log_probs=[float(x) for x in last.log_probs],
            finish_reason=last.finish_reason,
            policy_version=min(row.policy_version for row in rows),
            # every call's, in order (--async_train: a sync can land between two calls of an episode)
            token_versions=[v for row in rows for v in row.token_versions],
            reward=outcome.reward,
            segments=rows,
            extra={
                "rollout/agent_calls": float(transcript.calls),
                "rollout/agent_segments": float(len(transcript.segments)),
                "rollout/agent_sealed": float(transcript.sealed),
                **{f"env/{name}": value for name, value in outcome.extra.items()},
            },
            **base,
        )

    def _log_dropped(self, dropped: list[tuple[Sample, str]]) -> None:
        for i, (s, session) in enumerate(dropped):
            what = s.dropped if i == 0 else s.dropped.splitlines()[-1]
            logger.warning(
                "agent episode dropped (prompt index %d, session %s; its group is not trained on): %s",
                s.group,
                session,
                what,
            )

    def score(self, samples: list[Sample]) -> tuple[torch.Tensor, dict[str, float]]:
        """The agents' rewards; the reward function's (or reward model's) where an agent returned None."""
        scores = torch.zeros(len(samples), dtype=torch.float32)
        extra: dict[str, float] = {}
        todo = [i for i, s in enumerate(samples) if s.dropped is None and s.reward is None]
        if todo:
            if self.fallback is None:
                s = samples[todo[0]]
                raise RuntimeError(
                    f"--agent_program returned no reward for prompt index {s.group} and the run has no reward "
                    f"function to score it: return a number, or pass --remote_rm_url / --reward_pretrain"
                )
            scored, extra = self.fallback.score([samples[i] for i in todo])
            scores[todo] = scored
        for i, s in enumerate(samples):
            if s.reward is not None:
                scores[i] = s.reward
        kept = [s for s in samples if s.dropped is None]
        return scores, {**extra, **(mean_extra(kept) if kept else {})}
