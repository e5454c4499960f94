"""The actor on a vision-language model: padded image rows scored as the HF model scores each row alone, the pixels
reaching the scores, and --freeze_visual_encoder freezing exactly the parameters outside the language model."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from openppo.errors import UserError
from openppo.models.actor import Actor
from openppo.models.vision import freeze_vision_tower, is_vision_language, language_parameter_names, pixel_inputs
from openppo.utils.images import decode_image_rows, encode_image_rows
from tests.model_cache import tiny_model_dir, tiny_vlm_dir


def user(text: str, num_images: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def processor():
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_vlm_dir())


def rows_of(processor, cases):
    """Right-padded [B, T] ids and mask of the expanded prompts + responses, and the rows' images."""
    seqs = []
    for text, images, response in cases:
        chat = processor.apply_chat_template(user(text, len(images)), add_generation_prompt=True)
        prompt = processor(text=[chat], images=[images] if images else None, return_tensors="pt")["input_ids"][
            0
        ].tolist()
        seqs.append((prompt, response))
    width = max(len(p) + len(r) for p, r in seqs)
    ids = torch.full((len(seqs), width), processor.tokenizer.pad_token_id)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, (p, r) in enumerate(seqs):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        mask[i, : len(p) + len(r)] = 1
    return seqs, ids, mask


def hf_row_logprobs(model, processor, prompt, response, images) -> torch.Tensor:
    pixels = processor.image_processor(images=[images], return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response]), **pixels).logits[0]
    scores = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)
    return scores.gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.parametrize("chunk_tokens", [0, 8])
def test_padded_image_rows_score_like_each_row_alone(processor, chunk_tokens):
    actor = Actor.from_pretrained(str(tiny_vlm_dir()), dtype=torch.float32).eval()
    assert is_vision_language(actor.config)
    assert actor.chunk_head(chunk_tokens) is None
    red, blue = Image.new("RGB", (50, 40), "red"), Image.new("RGB", (30, 30), "blue")
    cases = [("Count.", [red], [11, 12, 13, 14, 15]), ("Which?", [red, blue], [21, 22]), ("Count.", [blue], [31, 32])]
    seqs, ids, mask = rows_of(processor, cases)
    images = [imgs for _, imgs, _ in cases]
    with torch.no_grad():
        out = actor(ids, mask, pixels=pixel_inputs(processor, images))
    for row, ((prompt, response), (_, imgs, _)) in enumerate(zip(seqs, cases)):
        expected = hf_row_logprobs(actor.hf_model, processor, prompt, response, imgs)
        got = out.log_probs[row, len(prompt) - 1 : len(prompt) - 1 + len(response)]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # The batch's encoded image rows (how images ride a training batch to the ranks) give the same scores.
    with torch.no_grad():
        riding = actor(ids, mask, images=encode_image_rows(images)).log_probs
    torch.testing.assert_close(riding, out.log_probs, atol=0, rtol=0)
    # The pixels reach the scores: rows 0 and 2 hold the same text and other images.
    with torch.no_grad():
        swapped = actor(ids, mask, pixels=pixel_inputs(processor, [[blue], [red, blue], [red]])).log_probs
    assert (swapped[0] - out.log_probs[0]).abs().max() > 1e-3


def test_a_text_row_beside_image_rows(processor):
    """A prompt without images in a batch of image prompts: scored as the text it is (the processor pads its image
    slot with an empty image, which the model leaves out), and a batch without any image gets no pixel input."""
    actor = Actor.from_pretrained(str(tiny_vlm_dir()), dtype=torch.float32).eval()
    image = Image.new("RGB", (44, 44), "orange")
    cases = [("Count.", [image], [3, 4, 5]), ("Just text.", [], [6, 7, 8, 9])]
    seqs, ids, mask = rows_of(processor, cases)
    with torch.no_grad():
        out = actor(ids, mask, images=encode_image_rows([[image], []])).log_probs
        text_only = actor(ids[1:], mask[1:]).log_probs[0]
    prompt, response = seqs[1]
    span = slice(len(prompt) - 1, len(prompt) - 1 + len(response))
    torch.testing.assert_close(out[1, span], text_only[span], atol=1e-5, rtol=0)
    assert actor.pixels_of(encode_image_rows([[], []])) is None
    with pytest.raises(ValueError, match="rows with image tokens reached the model without their images"):
        actor(ids, mask)
    rows = [[image, "data:image/png;base64,AAAA"], [], [{"bytes": b"x", "path": None}]]
    assert decode_image_rows(encode_image_rows(rows))[1:] == rows[1:]


def test_a_response_ending_with_a_sampled_image_placeholder(processor):
    """The engine stops a response at a sampled image placeholder (`VLLMEngine.placeholder_stop_ids`); the actor then
    scores it, the placeholder's log-prob from the position before, exactly as the HF model scores the row without
    it, in an image row and in a text row beside it; a placeholder anywhere else in a text row is still refused."""
    from openppo.models.vision import end_placeholders, image_placeholder_ids

    actor = Actor.from_pretrained(str(tiny_vlm_dir()), dtype=torch.float32).eval()
    placeholder = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert image_placeholder_ids(actor.config) == [placeholder]
    image = Image.new("RGB", (44, 44), "teal")
    cases = [("Count.", [image], [3, 4, placeholder]), ("Just text.", [], [6, placeholder]), ("Count.", [image], [5])]
    seqs, ids, mask = rows_of(processor, cases)
    with torch.no_grad():
        out = actor(ids, mask, images=encode_image_rows([imgs for _, imgs, _ in cases])).log_probs
    for row, (prompt, response) in enumerate(seqs):
        pixels = processor.image_processor(images=[cases[row][1]], return_tensors="pt") if cases[row][1] else {}
        with torch.no_grad():  # the row without its last token: the placeholder is never read
            logits = actor.hf_model(input_ids=torch.tensor([prompt + response[:-1]]), **pixels).logits[0]
        expected = torch.log_softmax(logits[len(prompt) - 1 :].float(), -1).gather(-1, torch.tensor(response)[:, None])
        got = out[row, len(prompt) - 1 : len(prompt) - 1 + len(response)]
        torch.testing.assert_close(got, expected[:, 0], atol=1e-5, rtol=0)
    # Only a row's last real token is replaced; the caller's ids are untouched, and so are the labels.
    replaced = end_placeholders(ids, mask, [placeholder], 0)
    assert (replaced != ids).sum() == 2 and ids.eq(placeholder).sum() > 2
    _, ids, mask = rows_of(processor, [("Just text.", [], [placeholder, 6])])  # not at the end: refused
    with pytest.raises(ValueError, match="rows with image tokens reached the model without their images"):
        actor(ids, mask)


def test_freeze_visual_encoder_moves_only_the_language_model(processor):
    actor = Actor.from_pretrained(str(tiny_vlm_dir()), dtype=torch.float32, freeze_visual_encoder=True)
    model = actor.hf_model
    language = language_parameter_names(model)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    names = {n for n, _ in model.named_parameters()}
    assert frozen == names - language and frozen and language
    assert all(".vision_model." in n or ".connector." in n for n in frozen)
    assert not any(".vision_model." in n or ".connector." in n for n in language)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    image = Image.new("RGB", (40, 40), "green")
    seqs, ids, mask = rows_of(processor, [("Count.", [image], [5, 6, 7])])
    out = actor(ids, mask, pixels=pixel_inputs(processor, [[image]]))
    (-out.log_probs[0, len(seqs[0][0]) - 1 :].sum()).backward()
    optimizer.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == names - frozen  # every language-model tensor moved, no frozen one did
    # Unfrozen, the same step moves the vision tower too: the gradient does reach it.
    full = Actor.from_pretrained(str(tiny_vlm_dir()), dtype=torch.float32)
    out = full(ids, mask, pixels=pixel_inputs(processor, [[image]]))
    (-out.log_probs[0].sum()).backward()
    assert all(
        p.grad is not None and p.grad.abs().sum() > 0 for n, p in full.hf_model.named_parameters() if n in frozen
    )
    assert sorted(freeze_vision_tower(full.hf_model)) == sorted(frozen)
    # the weight sync leaves the frozen tower out (the engines loaded it from the same checkpoint)
    from openppo.rollout.sender import iter_full_weights

    sent = {name for name, _ in iter_full_weights(actor, rank=0)}
    assert sent == {n for n in language if n != "lm_head.weight"}  # (the tied head is the embedding, sent once)


def test_text_models_are_not_vision_language():
    from transformers import AutoConfig

    assert not is_vision_language(AutoConfig.from_pretrained(tiny_model_dir()))
    with pytest.raises(AssertionError, match="no row has an image"):
        pixel_inputs(None, [[]])


def test_lora_adapts_the_language_model_only(processor):
    actor = Actor.from_pretrained(str(tiny_vlm_dir()), dtype=torch.float32, lora_rank=4, lora_alpha=8)
    adapted = {n for n, _ in actor.model.named_parameters() if "lora_" in n}
    trainable = {n for n, p in actor.model.named_parameters() if p.requires_grad}
    assert adapted and trainable == adapted
    assert all(".text_model." in n for n in adapted)  # none in the vision tower or the connector
    image = Image.new("RGB", (40, 40), "pink")
    seqs, ids, mask = rows_of(processor, [("Count.", [image], [5, 6, 7])])
    out = actor(ids, mask, images=encode_image_rows([[image]]))
    (-out.log_probs[0].sum()).backward()
    assert all(p.grad is not None for n, p in actor.model.named_parameters() if n in trainable)
    only_q = Actor.from_pretrained(str(tiny_vlm_dir()), dtype=torch.float32, lora_rank=4, target_modules=["q_proj"])
    names = {n.rpartition(".lora_")[0] for n, _ in only_q.model.named_parameters() if "lora_" in n}
    assert names and all(n.endswith("self_attn.q_proj") and ".text_model." in n for n in names)
    with pytest.raises(UserError, match="--target_modules fc1: none of the language model's linear layers"):
        Actor.from_pretrained(str(tiny_vlm_dir()), dtype=torch.float32, lora_rank=4, target_modules=["fc1"])
