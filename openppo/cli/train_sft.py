"""Supervised fine-tuning: `deepspeed --module openppo.cli.train_sft ...` or `torchrun -m openppo.cli.train_sft`."""

from __future__ import annotations

import functools
import logging
import sys

from openppo.cli.runner import run_cli
from openppo.errors import require
from openppo.trainers.configs import SFTConfig, SFTDataConfig

logger = logging.getLogger(__name__)


def train(cfg: SFTConfig) -> None:
    # imported here, not at the top: `--help` and a bad flag need the config alone (cli/train_ppo_ray.py)
    from openppo.datasets import SFTDataset, collate_packed, collate_padded
    from openppo.models.actor import Actor, use_chunked_head
    from openppo.models.hf import load_tokenizer
    from openppo.trainers import setup
    from openppo.trainers.loop import SupervisedTrainer
    from openppo.trainers.stages import SFTTrainer

    setup.validate_common(cfg)
    require(
        not cfg.data.multiturn or cfg.data.apply_chat_template,
        "--multiturn needs --apply_chat_template (turn boundaries come from the chat template)",
    )
    if cfg.data.train_on_last_turn_only and not cfg.data.multiturn:
        logger.info("note: --train_on_last_turn_only has no effect without --multiturn: each row has one turn")
    single_turn = not (cfg.data.multiturn or cfg.data.pretrain_mode)
    keys = {"--input_key": cfg.data.input_key, "--output_key": cfg.data.output_key if single_turn else None}
    processor = image_processor(cfg)
    raw_train, raw_eval = setup.load_raw_data(cfg.data, keys, cfg.optim.seed)
    tokenizer = load_tokenizer(
        cfg.model.pretrain,
        chat_template=cfg.data.tokenizer_chat_template,
        use_fast=not cfg.data.disable_fast_tokenizer,
    )
    make = functools.partial(
        SFTDataset,
        tokenizer=tokenizer,
        max_len=cfg.data.max_len,
        input_key=cfg.data.input_key,
        output_key=cfg.data.output_key,
        apply_chat_template=cfg.data.apply_chat_template,
        input_template=cfg.data.input_template,
        multiturn=cfg.data.multiturn,
        pretrain_mode=cfg.data.pretrain_mode,
        last_turn_only=cfg.data.train_on_last_turn_only,
        image_key=cfg.data.image_key,
        max_images=cfg.data.max_images_per_prompt,
        processor=processor,
    )
    train_ds = make(raw_train)
    eval_ds = make(raw_eval) if raw_eval is not None else None
    strategy = setup.make_strategy(cfg)
    # packed rows come packed from the collator, except a ring's: its layout packs and shards the padded batch
    collate = (
        collate_packed
        if cfg.data.packing_samples and cfg.ds.ring_attn_size == 1
        else functools.partial(collate_padded, pad_token_id=tokenizer.pad_token_id)
    )
    with strategy.zero3_init():
        actor = Actor.from_pretrained(
            cfg.model.pretrain,
            dtype=strategy.torch_dtype,
            freeze_visual_encoder=cfg.model.freeze_visual_encoder,
            **cfg.model.build_kwargs(),
        )
    if cfg.ds.ring_attn_size > 1:
        setup.set_layout(cfg, actor)
    else:  # (a packed batch comes packed from the collator: the layout stays padded)
        use_chunked_head(actor, cfg.model.lm_head_chunk_tokens)
    steps = SupervisedTrainer.num_training_steps(len(train_ds), cfg.optim)
    engine = strategy.prepare_train(actor, **setup.optimizer_kwargs(cfg, steps))
    tracker = setup.make_tracker(cfg, strategy, "train_sft")
    try:
        SFTTrainer(**setup.train_kwargs(cfg, strategy, engine, tokenizer, train_ds, eval_ds, collate, tracker)).fit()
    finally:
        tracker.close()


def image_processor(cfg: SFTConfig):
    """The processor of a vision-language --pretrain for image samples (--image_key), else None; image samples are
    padded rows, so packing (and the ring, which packs) is refused. --freeze_visual_encoder on a text model says in
    one line that it has no effect."""
    from transformers import AutoConfig

    from openppo.models.hf import resolve_model_path
    from openppo.models.vision import is_vision_language

    require(
        cfg.data.image_key is None or not cfg.data.packing_samples,
        "--image_key: image samples are padded rows (their pixels go with the row); drop --packing_samples",
    )
    if cfg.data.image_key is None and cfg.data.max_images_per_prompt != SFTDataConfig.max_images_per_prompt:
        logger.info("note: --max_images_per_prompt has no effect without --image_key: the samples are text only")
    if cfg.data.image_key is None and not cfg.model.freeze_visual_encoder:
        return None
    path = resolve_model_path(cfg.model.pretrain, "--pretrain")
    vision = is_vision_language(AutoConfig.from_pretrained(path, trust_remote_code=True))
    if cfg.model.freeze_visual_encoder and not vision:
        logger.info("note: --freeze_visual_encoder has no effect: --pretrain is not a vision-language model")
    if cfg.data.image_key is None:
        return None
    require(vision, f"--image_key: --pretrain {cfg.model.pretrain} is not a vision-language model (no vision tower)")
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path, trust_remote_code=True)


def main(argv=None) -> int:
    return run_cli(train, SFTConfig, "openppo.cli.train_sft", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
