"""Multi-turn rollouts: model turns and environment feedback interleaved in one token sequence.

Each sample is an episode: prompt, model turn, feedback, model turn, ... The model's tokens are kept exactly as
the engine sampled them, never re-tokenized from text (decode -> encode does not round-trip, so re-encoding
would train the policy on tokens it did not sample, with log-probs that do not belong to them). Feedback is
encoded once, on its own, and appended; it stays in the sequence as context for later turns with
`action_mask` 0 and rollout log-prob 0.0, so the loss ignores it.

Batching: every turn sends all still-running episodes to the engine in one `generate` call, so a whole batch costs
at most `max_turns` calls. Their steps then run one by one, or together where the environment class has a
`step_all` (Molt's async environments: awaited concurrently, as Molt does, so a turn of episodes that each wait on a
tool server takes one wait, not one per episode). An episode's next context is its prompt plus its whole
response so far, so an engine with prefix caching reuses the earlier turns' KV blocks.

Length: no sample grows past `max_total_len` tokens (prompt included). A turn may generate
min(max_new_tokens, room left); feedback that does not fit is cut to the room left and ends the episode.

Image prompts (items with "images"): every turn sends the episode's context with its image placeholders unexpanded
and its images beside it, as a single-turn rollout does; the engine expands them, and the first turn's expanded
prompt is the sample's (what the trainer scores with the images). A step may show images with its feedback
(`StepResult.images`, one per image placeholder in its text, as OpenRLHF's `environment_images`): the episode's row
gets the feedback as `expand_images` (the model's processor) expands it, the context the engine gets keeps its
placeholders, and each later turn checks that the engine expanded the context into exactly the row so far. The room
left counts expanded tokens; feedback with images that does not fit ends the episode without it (an image's tokens
cannot be cut). A turn that ends on a sampled image placeholder (`image_placeholders`: the engines stop there) ends
its episode: the placeholder could not go back to the engine without an image of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from openppo.agents.base import AgentEnv, AgentError, EnvTimeout, StepResult
from openppo.rollout.pool import Sample
from openppo.utils.time_limit import CallThread, Late

GenerateFn = Callable[..., list[dict]]
"""(prompt token ids per request, max_new_tokens per request[, images=per request]) -> one {token_ids, logprobs,
finish_reason} each, with `prompt_token_ids` (the prompt as the engine expanded its images) where images were given"""


@dataclass
class _Episode:
    item: dict[str, Any]
    env: AgentEnv
    response_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    reward: float = 0.0
    num_turns: int = 0
    finish_reason: str = "stop"
    extra: dict[str, float] = field(default_factory=dict)
    expanded_prompt: list[int] | None = None  # an image prompt as the engine expanded it (its first turn's)
    sent_ids: list[int] = field(default_factory=list)  # the response as the engine gets it (placeholders unexpanded)
    feedback_images: list[Any] = field(default_factory=list)  # the images the steps showed, in order

    @property
    def context(self) -> list[int]:
        return list(self.item["prompt_ids"]) + self.sent_ids

    @property
    def images(self) -> list[Any]:
        return list(self.item.get("images") or ()) + self.feedback_images

    def room(self, max_total_len: int) -> int:
        """Tokens left under `max_total_len`, the prompt counted as the engine expanded it (once known)."""
        prompt = self.item["prompt_ids"] if self.expanded_prompt is None else self.expanded_prompt
        return max_total_len - len(prompt) - len(self.response_ids)

    def append(self, token_ids: list[int], log_probs: list[float] | None, sent: list[int] | None = None) -> None:
        """Model tokens (with their log-probs) or feedback tokens (log_probs None: masked out); `sent`: the feedback
        as the engine gets it, where its images' placeholders are unexpanded."""
        self.sent_ids += token_ids if sent is None else sent
        self.response_ids += token_ids
        self.action_mask += [1 if log_probs is not None else 0] * len(token_ids)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(token_ids)


_ENV_THREAD = CallThread("agent-env")
"""every call into an environment, its construction and its steps (see CallThread: thread-bound objects work)"""


def _env_call(fn: Callable[[], Any], timeout_s: float | None, what: str) -> Any:
    """`fn()` on the environments' thread; EnvTimeout naming `what` when it has not returned after `timeout_s`:
    a step that never returns (a remote tool that hangs) stops the rollout instead of hanging the run."""
    try:
        return _ENV_THREAD.run(fn, timeout_s)
    except Late:
        raise EnvTimeout(f"{what} did not return within {timeout_s:g} s (--agent_timeout)") from None


def _where(ep: _Episode, turn: int) -> str:
    return f"{type(ep.env).__name__}.step (prompt index {ep.item['index']}, turn {turn})"


def _step(ep: _Episode, text: str, turn: int, timeout_s: float | None) -> StepResult:
    """`env.step` within `timeout_s`, with errors that say which environment, prompt and turn failed."""
    try:
        result = _env_call(lambda: ep.env.step(text, turn), timeout_s, _where(ep, turn))
    except EnvTimeout:
        raise
    except Exception as err:
        result = err
    return _checked(ep, turn, result, timeout_s)


def _checked(ep: _Episode, turn: int, result: Any, timeout_s: float | None) -> StepResult:
    """A step's StepResult, or the AgentError its failure (`result` an exception) or wrong return is."""
    where = _where(ep, turn)
    if isinstance(result, EnvTimeout):  # (a `step_all`'s late step)
        raise EnvTimeout(f"{where} did not return within {timeout_s:g} s (--agent_timeout)")
    if isinstance(result, BaseException):
        raise AgentError(f"{where} raised {type(result).__name__}: {result}") from result
    if not isinstance(result, StepResult):
        raise AgentError(f"{where} returned {type(result).__name__}; return openppo.agents.StepResult(...)")
    return result


def _step_all(eps: list[_Episode], texts: list[str], turn: int, timeout_s: float | None) -> list[StepResult]:
    """Every running episode's step of a turn: together where the environment class takes them so
    (`step_all(envs, texts, turn, timeout_s)`, Molt's async environments, awaited concurrently), else one by one."""
    together = getattr(type(eps[0].env), "step_all", None) if eps else None
    if together is None:
        return [_step(ep, text, turn, timeout_s) for ep, text in zip(eps, texts)]
    results = together([ep.env for ep in eps], texts, turn, timeout_s)
    return [_checked(ep, turn, result, timeout_s) for ep, result in zip(eps, results)]


def run_agent_episodes(
    generate: GenerateFn,
    tokenizer,
    items: list[dict[str, Any]],
    *,
    n_samples_per_prompt: int,
    env_cls: type[AgentEnv],
    max_turns: int,
    max_new_tokens: int,
    max_total_len: int,
    feedback_template: str = "{}",
    env_timeout_s: float | None = None,
    image_placeholders: Sequence[int] = (),
    expand_images: Callable[[str, list[Any]], list[int]] | None = None,
    max_images: int = 0,
) -> list[Sample]:
    """Run `n_samples_per_prompt` episodes per item, all episodes' turns batched, and return one Sample each.

    Args:
        generate: see `GenerateFn`; `engine_generate_fn` adapts `VLLMEngine.generate` to it.
        tokenizer: decodes model turns for the environment and encodes feedback (no special tokens added).
        items: prompt-dataset items (prompt, prompt_ids, label, index).
        env_cls: built once per episode with (prompt, label), in output order.
        max_turns: model turns per episode at most.
        max_new_tokens: tokens per model turn at most.
        max_total_len: prompt + response tokens per sample at most.
        feedback_template: `feedback_template.format(feedback)` is what gets encoded (e.g. chat turn markers).
        env_timeout_s: seconds one environment construction or step may take (None: no limit); a late one raises
            AgentError.
        image_placeholders: the policy's image placeholder ids (image prompts: a turn ending on one ends its episode).
        expand_images: (feedback text, its images) -> its token ids with the images expanded, as the engine expands
            them (the model's processor); None: steps may not show images.
        max_images: images an episode may hold, prompt and feedback together (the engines' per-prompt limit).

    Returns samples in item order, n consecutive per item, with `group = item["index"]`, the summed step rewards
    in `reward`, `extra["rollout/agent_turns"]` plus the environment's last `extra` as `env/<name>`, and
    `finish_reason` "length" when the episode hit `max_total_len` or its last model turn hit `max_new_tokens`.
    """
    if max_turns < 1 or max_new_tokens < 1 or n_samples_per_prompt < 1:
        raise ValueError(
            f"max_turns, max_new_tokens, n_samples_per_prompt must be >= 1, got "
            f"{max_turns}, {max_new_tokens}, {n_samples_per_prompt}"
        )
    for item in items:
        if len(item["prompt_ids"]) >= max_total_len:
            raise ValueError(
                f"prompt index {item['index']} has {len(item['prompt_ids'])} tokens, which leaves no "
                f"room under max_total_len={max_total_len}"
            )

    def build(item: dict[str, Any]) -> AgentEnv:
        what = f"{env_cls.__name__}(prompt index {item['index']})"
        try:
            return _env_call(lambda: env_cls(item["prompt"], item["label"]), env_timeout_s, what)
        except AgentError:
            raise
        except Exception as err:
            raise AgentError(f"{what} raised {type(err).__name__}: {err}") from err

    episodes = [_Episode(item, build(item)) for item in items for _ in range(n_samples_per_prompt)]
    active = list(episodes)
    for turn in range(max_turns):
        if not active:
            break
        contexts = [ep.context for ep in active]
        # >= 1: an episode whose feedback fills the last free token has already ended (below).
        budgets = [min(max_new_tokens, ep.room(max_total_len)) for ep in active]
        if any(ep.images for ep in active):  # image prompts: each context's images beside it
            outputs = generate(contexts, budgets, images=[ep.images for ep in active])
        else:
            outputs = generate(contexts, budgets)
        assert len(outputs) == len(active), f"generate returned {len(outputs)} completions for {len(active)}"
        texts = []
        for ep, budget, out in zip(active, budgets, outputs):
            token_ids, log_probs = list(out["token_ids"]), list(out["logprobs"])
            assert len(token_ids) <= budget and len(log_probs) == len(token_ids), "generate broke its contract"
            if turn == 0 and "prompt_token_ids" in out:  # the first turn's context is the prompt alone
                ep.expanded_prompt = list(out["prompt_token_ids"])
            elif ep.feedback_images and list(out["prompt_token_ids"]) != ep.expanded_prompt + ep.response_ids:
                raise AgentError(
                    f"{_where(ep, turn)}: the engine expanded the images of the feedback into other tokens than "
                    "the model's processor did; the row would not be what the engine saw"
                )
            ep.append(token_ids, log_probs)
            ep.num_turns += 1
            # (the engines stop on stop tokens only: a turn that finished with "stop" ends with one)
            stopped = out["finish_reason"] == "stop" and token_ids and not ep.env.decode_stop_token
            shown = token_ids[:-1] if stopped else token_ids
            texts.append(tokenizer.decode(shown, skip_special_tokens=not ep.env.decode_special_tokens))
        still_active = []
        for ep, out, result in zip(active, outputs, _step_all(active, texts, turn, env_timeout_s)):
            ep.reward += float(result.reward)
            ep.extra.update({str(k): float(v) for k, v in result.extra.items()})
            placeholder = bool(out["token_ids"]) and out["token_ids"][-1] in image_placeholders
            if result.done or turn + 1 == max_turns or placeholder:
                ep.finish_reason = "length" if out["finish_reason"] == "length" else "stop"
                continue
            text = feedback_template.format(result.feedback)
            feedback = tokenizer.encode(text, add_special_tokens=False)
            room = ep.room(max_total_len)
            if result.images:
                pictures = list(result.images)
                expanded = _expanded_feedback(ep, turn, pictures, text, feedback, expand_images, image_placeholders)
                if len(ep.images) + len(pictures) > max_images:
                    raise AgentError(
                        f"{_where(ep, turn)} showed {len(pictures)} image(s), {len(ep.images)} were shown before, "
                        f"and --max_images_per_prompt {max_images} caps an episode's images (prompt and feedback "
                        "together): raise it"
                    )
                if len(expanded) >= room:  # (an image's tokens cannot be cut)
                    ep.finish_reason = "length"
                    continue
                ep.append(expanded, None, sent=feedback)
                ep.feedback_images += pictures
                still_active.append(ep)
                continue
            if len(feedback) >= room:  # no room left for another model turn after it
                ep.append(feedback[:room], None)
                ep.finish_reason = "length"
                continue
            ep.append(feedback, None)
            still_active.append(ep)
        active = still_active
    return [_to_sample(ep, tokenizer) for ep in episodes]


def _expanded_feedback(
    ep: _Episode,
    turn: int,
    images: list[Any],
    text: str,
    feedback: list[int],
    expand_images: Callable[[str, list[Any]], list[int]] | None,
    placeholders: Sequence[int],
) -> list[int]:
    """The feedback's tokens with its images expanded, after checking that the run takes images and that its text
    shows one placeholder per image."""
    if expand_images is None:
        raise AgentError(
            f"{_where(ep, turn)} showed {len(images)} image(s): feedback images need image prompts "
            "(--max_images_per_prompt > 0 and a vision-language --pretrain)"
        )
    shown = sum(token in placeholders for token in feedback)
    if shown != len(images):
        raise AgentError(
            f"{_where(ep, turn)} showed {len(images)} image(s) with feedback whose text holds {shown} image "
            "placeholder(s): put the model's image placeholder in the text once per image"
        )
    return expand_images(text, list(images))


def _to_sample(ep: _Episode, tokenizer) -> Sample:
    item = ep.item
    return Sample(
        prompt_ids=list(item["prompt_ids"] if ep.expanded_prompt is None else ep.expanded_prompt),
        response_ids=ep.response_ids,
        rollout_log_probs=ep.log_probs,
        finish_reason=ep.finish_reason,
        group=item["index"],
        label=item["label"],
        prompt_text=item["prompt"],
        response_text=tokenizer.decode(ep.response_ids, skip_special_tokens=True),
        action_mask=ep.action_mask,
        reward=ep.reward,
        extra={"rollout/agent_turns": float(ep.num_turns), **{f"env/{k}": v for k, v in ep.extra.items()}},
        images=ep.images or None,
    )


def engine_generate_fn(engine_generate: Callable[..., list[list[dict]]], **sampling: Any) -> GenerateFn:
    """Adapt a `VLLMEngine.generate`-like callable (a budget per prompt) to `GenerateFn`: one call with n=1, each
    prompt's own budget, its images where given, and `sampling` (temperature, top_p, ...) passed through.
    For a Ray actor: `engine_generate_fn(lambda ids, **kw: ray.get(actor.generate.remote(ids, **kw)), ...)`.
    """

    def generate(prompt_ids: list[list[int]], budgets: list[int], images: list | None = None) -> list[dict]:
        given = {} if images is None else {"images": images}
        completions = engine_generate(prompt_ids, n=1, max_new_tokens=list(budgets), **sampling, **given)
        return [samples[0] for samples in completions]

    return generate
