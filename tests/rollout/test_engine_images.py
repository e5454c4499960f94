"""VLLMEngine with image prompts (real vLLM on CPU, the tiny Idefics3 VLM in fp32): the engine expands each image
placeholder as the model's processor does, and its log-probs match the HF model given the same pixels; prompts that
differ only in their images share no cached KV."""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw

from tests import ray_cluster
from tests.model_cache import tiny_vlm_dir

TOL = 1e-4


def picture(shapes: int, color: str) -> Image.Image:
    image = Image.new("RGB", (60, 44), "white")
    draw = ImageDraw.Draw(image)
    for k in range(shapes):
        draw.ellipse((4 + 14 * k, 6, 14 + 14 * k, 16), fill=color)
    return image


def user(text: str, num_images: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def vlm():
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = tiny_vlm_dir()
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, AutoProcessor.from_pretrained(path)


@pytest.fixture(scope="module")
def engine(vlm):
    import ray

    from openppo.rollout import VLLMEngine

    ray_cluster.connect()
    try:
        actor = ray.remote(num_cpus=1)(VLLMEngine).remote(
            str(vlm[0]),
            dtype="float32",
            seed=0,
            max_model_len=256,
            kv_cache_bytes=64 << 20,
            enable_prefix_caching=True,
            max_images_per_prompt=2,
        )
        ray.get(actor.ready.remote(), timeout=240)
        yield actor
        ray.kill(actor)
    finally:
        ray.shutdown()


def hf_logprobs(model, processor, text: str, images: list, response: list[int]) -> tuple[list[int], torch.Tensor]:
    """The processor's expanded prompt ids, and the HF model's log-probs of `response` after it given the pixels."""
    enc = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    prompt = enc["input_ids"][0].tolist()
    pixels = {k: v for k, v in enc.items() if k.startswith("pixel")}
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response]), **pixels, use_cache=False).logits[0]
    scores = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)
    return prompt, scores.gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.slow
def test_image_prompts_match_hf_and_do_not_share_kv(engine, vlm):
    import ray

    _, model, processor = vlm
    tok = processor.tokenizer
    image_id = tok.convert_tokens_to_ids("<image>")
    cases = [
        ("How many circles?", [picture(2, "red")]),
        ("How many circles?", [picture(3, "blue")]),  # same text, another image: no KV may be shared
        ("Which has more?", [picture(1, "red"), picture(3, "green")]),
        ("No picture here.", []),
    ]
    texts = [processor.apply_chat_template(user(q, len(imgs)), add_generation_prompt=True) for q, imgs in cases]
    prompt_ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert [ids.count(image_id) for ids in prompt_ids] == [1, 1, 2, 0]  # unexpanded: one placeholder per image
    out = ray.get(
        engine.generate.remote(
            prompt_ids, n=2, max_new_tokens=10, temperature=1.0, top_p=1.0, images=[imgs for _, imgs in cases]
        ),
        timeout=180,
    )
    for (question, imgs), text, samples in zip(cases, texts, out):
        for sample in samples:
            expanded, expected = hf_logprobs(model, processor, text, imgs, sample["token_ids"])
            if imgs:
                assert sample["prompt_token_ids"] == expanded
                assert expanded.count(image_id) == len(imgs) * 4  # 56 px / 14 px patches, 2x2 merged: 4 tokens
            else:
                assert "prompt_token_ids" not in sample
            gap = (expected - torch.tensor(sample["logprobs"])).abs().max().item()
            assert gap < TOL, f"{question!r} with {len(imgs)} image(s): engine vs HF log-prob gap {gap:.2e}"
    # The pixels matter: scored under the other image, the first prompt's sample has other log-probs.
    first = out[0][0]["token_ids"]
    _, own = hf_logprobs(model, processor, texts[0], cases[0][1], first)
    _, other = hf_logprobs(model, processor, texts[0], cases[1][1], first)
    assert (own - other).abs().max().item() > 100 * TOL


@pytest.mark.slow
def test_weight_sync_covers_the_vision_tower(engine, vlm):
    """Every tensor of the VLM, vision tower and connector included, lands in the engine exactly, and generation
    with an image follows the new weights (no vision-encoder output cached under the old weights is reused); with the
    tower frozen, a sync of the language model alone suffices."""
    import ray

    from openppo.models.vision import language_parameter_names
    from openppo.rollout.readback import check_engine_weights
    from openppo.rollout.sender import connect_engines, sync_weights

    _, model, processor = vlm
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    text = processor.apply_chat_template(user("How many?", 1), add_generation_prompt=True)
    ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    image = picture(2, "purple")

    def generate_and_check(what: str) -> None:
        [[sample]] = ray.get(
            engine.generate.remote([ids], n=1, max_new_tokens=8, temperature=1.0, top_p=1.0, images=[[image]]),
            timeout=60,
        )
        _, expected = hf_logprobs(model, processor, text, [image], sample["token_ids"])
        gap = (expected - torch.tensor(sample["logprobs"])).abs().max().item()
        assert gap < TOL, f"{what}: engine vs HF log-prob gap {gap:.2e}"

    def engine_check():
        return check_engine_weights(model.named_parameters(), ray.get(engine.read_weights.remote(), timeout=60))

    generate_and_check("before any sync")  # the image's encoder output is now cached (the old weights')
    group = connect_engines([engine], backend="gloo", master_addr="127.0.0.1", timeout_s=60)
    try:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        stale = engine_check()
        assert not stale.ok() and min(stale.rel_diff.values()) > 0, stale.summary()
        sync_weights(model, group, [engine], bucket_bytes=64 << 10, timeout_s=60, verify=True)
        synced = engine_check()
        assert synced.ok() and max(synced.rel_diff.values()) == 0.0, synced.summary()
        assert any(".vision_model." in n for n in synced.rel_diff) and any(".connector." in n for n in synced.rel_diff)
        generate_and_check("after a full sync")
        # Frozen tower: only the language model changes and is sent; the engine then matches the whole model.
        language = language_parameter_names(model)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in language:
                    p.copy_(original[n])
        sent = [(n, p.detach()) for n, p in model.named_parameters() if n in language]
        sync_weights(sent, None, [engine], bucket_bytes=1 << 20, timeout_s=60)
        assert engine_check().ok()
        generate_and_check("after a language-model-only sync")
    finally:
        group.destroy()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(original[n])


@pytest.mark.slow
def test_a_sampled_image_placeholder_ends_the_response(engine, vlm):
    """A policy that favours its image placeholder (synced into the engine) samples it; the response stops there, so
    the placeholder is always its last token, and the actor scores the row as the engine did."""
    import ray

    from openppo.models.actor import Actor
    from openppo.models.zoo import favour_tokens
    from openppo.rollout.sender import sync_weights
    from openppo.utils.images import encode_image_rows

    path, model, processor = vlm
    actor = Actor.from_pretrained(str(path), dtype=torch.float32).eval()
    placeholder = processor.tokenizer.convert_tokens_to_ids("<image>")
    text = processor.apply_chat_template(user("How many?", 1), add_generation_prompt=True)
    image = picture(1, "black")
    enc = processor(text=[text], images=[[image]], return_tensors="pt")
    with torch.no_grad():
        favour_tokens(actor.hf_model, [placeholder], 1.25, actor.hf_model.model(**enc).last_hidden_state[:, -1])
    try:
        sync_weights(actor.hf_model, None, [engine], 1 << 20, timeout_s=60)
        ids = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        [samples] = ray.get(
            engine.generate.remote([ids], n=8, max_new_tokens=6, temperature=1.0, top_p=1.0, images=[[image]]),
            timeout=60,
        )
        ended = [s for s in samples if placeholder in s["token_ids"]]
        # ~72 % at the first position (scale 1.0 gave 26 %, and a run with AVX2 kernels drew it in none of the
        # 8 samples): none of 8 taking it is now under 1e-4
        assert ended, [s["token_ids"] for s in samples]
        for sample in ended:
            assert sample["token_ids"].index(placeholder) == len(sample["token_ids"]) - 1
            assert sample["finish_reason"] == "stop"
        width = max(len(s["prompt_token_ids"]) + len(s["token_ids"]) for s in samples)
        rows = torch.zeros(len(samples), width, dtype=torch.long)
        mask = torch.zeros_like(rows)
        for i, s in enumerate(samples):
            seq = s["prompt_token_ids"] + s["token_ids"]
            rows[i, : len(seq)], mask[i, : len(seq)] = torch.tensor(seq), 1
        with torch.no_grad():
            scores = actor(rows, mask, images=encode_image_rows([[image]] * len(samples))).log_probs
        for i, s in enumerate(samples):
            start = len(s["prompt_token_ids"]) - 1
            got = scores[i, start : start + len(s["token_ids"])]
            gap = (got - torch.tensor(s["logprobs"])).abs().max().item()
            assert gap < TOL, f"sample {s['token_ids']}: actor vs engine log-prob gap {gap:.2e}"
    finally:
        sync_weights(model, None, [engine], 1 << 20, timeout_s=60)
