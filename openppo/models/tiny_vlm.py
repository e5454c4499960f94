"""A tiny random vision-language model of a real architecture, with a real processor, for tests and CPU demos.

The architecture is Idefics3, the one SmolVLM ships: a SigLIP-style vision transformer, a pixel-shuffle connector
that merges `scale_factor**2` patches into one token, and a Llama decoder. The tokenizer is the one the tiny text
models use (Qwen3's, or its 8k cut) with Idefics3's image tokens added, and the processor is transformers'
`Idefics3Processor` with its PIL image backend; vLLM serves the folder with its own Idefics3 implementation.

Why not Qwen2-VL, the family OpenRLHF's VLM recipes train: in transformers 5.19 its processor needs a video
processor, which needs torchvision, and vLLM 0.32's Qwen2-VL module imports torchvision too. The torchvision that
matches vLLM's pinned `torch==2.13.0+cpu` is published only on download.pytorch.org, which these boxes cannot
reach; PyPI's torchvision is a CUDA build (its `_C.so` needs libtorch_cuda.so) and breaks `import torchvision`
beside a CPU torch. Idefics3's processor and vLLM's Idefics3 module need no torchvision, so the same code path
(AutoProcessor, AutoModelForImageTextToText, vLLM's multimodal inputs) runs here; Qwen2-VL-class models take that
path on a GPU box, where torchvision is installed with torch (docs/vlm.md).

Images are one global tile (`do_image_splitting=False`): `image_size` square, `(image_size / patch_size)**2 /
scale_factor**2` image tokens each (4 at the defaults), so a test prompt stays a few dozen tokens long.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openppo.errors import require
from openppo.models.zoo import (
    _RECIPE_VERSION,
    _cached_build,
    _tiny_tokenizer,
    _validate_tiny,
    favour_tokens,
    qwen3_tokenizer_dir,
)

# Idefics3Processor's own token strings: the image placeholder, the markers around an image, the end of a turn,
# the global-tile tag and the tile tags of split images (unused here, but the processor looks them up).
IMAGE_TOKEN = "<image>"
_IMAGE_TOKENS = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]

# ChatML, with `{"type": "image"}` content items rendered as the image placeholder, which the processor expands.
VLM_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}{{- '" + IMAGE_TOKEN + "' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tiny_vlm(
    out_dir: str | Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 2,
    intermediate_size: int = 128,
    vision_layers: int = 2,
    vision_hidden_size: int = 32,
    image_size: int = 56,
    patch_size: int = 14,
    scale_factor: int = 2,
    seed: int = 0,
    tokenizer: str = "qwen3",
    dtype: str = "float32",
    answers: tuple[str, ...] = (),
    answer_scale: float = 3.0,
) -> Path:
    """A tiny random Idefics3 model with its processor, saved like a real checkpoint in `out_dir`; cached.

    Same conventions as `zoo.build_tiny_model`: tied embeddings, `vocab_size == len(tokenizer)`, bit-identical
    weights for the same arguments (initialised under `seed` in a forked RNG), eos `<|im_end|>`, pad `<|endoftext|>`.
    `answers`: one-token strings the fresh model already says, uniformly among them, at most positions
    (`zoo.favour_tokens` with `answer_scale`): a start that RL can learn from, as in the CPU VLM demo, where the
    answers are the counts 1..4 and a random model would otherwise never say a number.
    """
    _validate_tiny("llama", num_layers, hidden_size, num_heads, intermediate_size, tokenizer, dtype)
    require(tokenizer != "gpt2", "--tokenizer gpt2: the tiny VLM needs a Qwen3 vocabulary (qwen3 or qwen3-8k)")
    side = image_size // patch_size
    require(
        image_size % patch_size == 0 and side % scale_factor == 0,
        f"--image_size {image_size} must be a multiple of patch_size*scale_factor ({patch_size * scale_factor})",
    )
    qwen3_tokenizer_dir()  # a missing package fails here, before anything is written
    build = {
        "kind": "tiny-vlm",
        "recipe": _RECIPE_VERSION,
        "arch": "idefics3",
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "intermediate_size": intermediate_size,
        "vision_layers": vision_layers,
        "vision_hidden_size": vision_hidden_size,
        "image_size": image_size,
        "patch_size": patch_size,
        "scale_factor": scale_factor,
        "seed": seed,
        "tokenizer": tokenizer,
        "dtype": dtype,
    }
    if answers:  # only then, so that the folders built before answers existed stay cached
        build.update(answers=list(answers), answer_scale=answer_scale)

    def make(tmp: Path) -> dict[str, Any]:
        import torch
        from transformers import GenerationConfig, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

        tok = _tiny_tokenizer(tokenizer)
        tok.add_special_tokens({"additional_special_tokens": _IMAGE_TOKENS})
        tok.chat_template = VLM_CHAT_TEMPLATE
        images = Idefics3ImageProcessorPil(
            do_image_splitting=False,
            size={"longest_edge": image_size},
            max_image_size={"longest_edge": image_size},
        )
        num_image_tokens = side * side // scale_factor**2
        processor = Idefics3Processor(
            image_processor=images, tokenizer=tok, image_seq_len=num_image_tokens, chat_template=VLM_CHAT_TEMPLATE
        )
        special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        text = dict(
            model_type="llama",
            vocab_size=len(tok),
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads,
            head_dim=hidden_size // num_heads,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            **special,
        )
        vision = dict(
            hidden_size=vision_hidden_size,
            intermediate_size=2 * vision_hidden_size,
            num_hidden_layers=vision_layers,
            num_attention_heads=2,
            image_size=image_size,
            patch_size=patch_size,
        )
        config = Idefics3Config(
            vision_config=vision,
            text_config=text,
            image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
            scale_factor=scale_factor,
            tie_word_embeddings=True,
            pad_token_id=tok.pad_token_id,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Idefics3ForConditionalGeneration(config)
        answer_ids = []
        for answer in answers:
            ids = tok.encode(answer, add_special_tokens=False)
            require(len(ids) == 1, f"--answers: {answer!r} is {len(ids)} tokens here; give one-token answers")
            answer_ids += ids
        if answer_ids:
            favour_tokens(model.eval(), answer_ids, answer_scale, _answer_states(model, processor, image_size))
        model.to(getattr(torch, dtype))
        model.generation_config = GenerationConfig(**special)
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        return {
            "model_type": config.model_type,
            "num_params": model.num_parameters(),
            "num_vision_params": sum(p.numel() for p in model.model.vision_model.parameters()),
            "dtype": dtype,
            "vocab_size": len(tok),
            "num_layers": num_layers,
            "hidden_size": hidden_size,
            "image_tokens": num_image_tokens,
            "eos_token": tok.eos_token,
            "pad_token": tok.pad_token,
            **({"answer_token_ids": answer_ids} if answer_ids else {}),
        }

    return _cached_build(out_dir, build, make)


def _answer_states(model, processor, image_size: int):
    """The final hidden states where an answer starts: after 16 one-image prompts of seeded noise pictures.

    Random text contexts (the text models' way) miss an image prompt's answer position: favoured from them, the
    answers took 0.8 % of it.
    """
    import numpy as np
    import torch
    from PIL import Image

    rng = np.random.default_rng(0)
    pictures = [[Image.fromarray(rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8))] for _ in range(16)]
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}]
    text = processor.apply_chat_template(prompt, add_generation_prompt=True)
    inputs = processor(text=[text] * len(pictures), images=pictures, return_tensors="pt")
    with torch.no_grad():
        return model.model(**inputs).last_hidden_state[:, -1]
