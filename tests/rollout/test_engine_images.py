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
