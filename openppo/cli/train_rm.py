"""Reward-model training on preference pairs: `deepspeed --module openppo.cli.train_rm ...`."""

from __future__ import annotations

import functools
import logging
import sys

from openppo.cli.runner import run_cli
from openppo.errors import require
from openppo.trainers.configs import RMConfig

logger = logging.getLogger(__name__)


def build_preference_data(cfg, tokenizer, raw_train, raw_eval, margin_key: str | None = None):
    from openppo.datasets import PreferenceDataset

    make = functools.partial(
        PreferenceDataset,
        tokenizer=tokenizer,
        max_len=cfg.data.max_len,
        prompt_key=cfg.data.prompt_key,
        chosen_key=cfg.data.chosen_key,
        rejected_key=cfg.data.rejected_key,
        apply_chat_template=cfg.data.apply_chat_template,
        input_template=cfg.data.input_template,
        margin_key=margin_key,
    )
    return make(raw_train), (make(raw_eval) if raw_eval is not None else None)


def preference_keys(cfg) -> dict:
    return {
        "--prompt_key": cfg.data.prompt_key,
        "--chosen_key": cfg.data.chosen_key,
        "--rejected_key": cfg.data.rejected_key,
    }


def train(cfg: RMConfig) -> None:
    # imported here, not at the top: `--help` and a bad flag need the config alone (cli/train_ppo_ray.py)
    from openppo.datasets import collate_pairs
    from openppo.models.hf import load_tokenizer
    from openppo.models.scalar import ScalarModel
    from openppo.trainers import setup
    from openppo.trainers.loop import SupervisedTrainer
    from openppo.trainers.stages import RewardModelTrainer

    setup.validate_common(cfg)
    require(
        cfg.rm.loss == "sigmoid" or not (cfg.rm.margin_loss or cfg.rm.margin),
        f"--margin and --margin_loss apply to --loss sigmoid; --loss {cfg.rm.loss} has no margin term",
    )
    raw_train, raw_eval = setup.load_raw_data(cfg.data, preference_keys(cfg), cfg.optim.seed)
    tokenizer = load_tokenizer(
        cfg.model.pretrain,
        chat_template=cfg.data.tokenizer_chat_template,
        use_fast=not cfg.data.disable_fast_tokenizer,
    )
    if cfg.rm.compute_fp32_loss:
        logger.warning("--compute_fp32_loss has no effect: the scores are cast to fp32 before the loss in every run")
    margin_key = "margin" if cfg.rm.margin_loss else None
    train_ds, eval_ds = build_preference_data(cfg, tokenizer, raw_train, raw_eval, margin_key)
    strategy = setup.make_strategy(cfg)
    with strategy.zero3_init():
        model = ScalarModel.from_pretrained(
            cfg.model.pretrain, dtype=strategy.torch_dtype, flag="--pretrain", **cfg.model.build_kwargs()
        )
    setup.set_layout(cfg, model)
    steps = SupervisedTrainer.num_training_steps(len(train_ds), cfg.optim)
    engine = strategy.prepare_train(model, **setup.optimizer_kwargs(cfg, steps))
    tracker = setup.make_tracker(cfg, strategy, "train_rm")
    collate = functools.partial(collate_pairs, pad_token_id=tokenizer.pad_token_id)
    try:
        RewardModelTrainer(
            loss=cfg.rm.loss,
            margin=cfg.rm.margin,
            **setup.train_kwargs(cfg, strategy, engine, tokenizer, train_ds, eval_ds, collate, tracker),
        ).fit()
    finally:
        tracker.close()


def main(argv=None) -> int:
    return run_cli(train, RMConfig, "openppo.cli.train_rm", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
