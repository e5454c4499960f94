"""DPO / IPO / cDPO on preference pairs: `deepspeed --module openppo.cli.train_dpo ...`."""

from __future__ import annotations

import functools
import sys

from openppo.cli.runner import run_cli
from openppo.cli.train_rm import build_preference_data, preference_keys
from openppo.errors import require
from openppo.trainers.configs import DPOConfig


def train(cfg: DPOConfig) -> None:
    # imported here, not at the top: `--help` and a bad flag need the config alone (cli/train_ppo_ray.py)
    from openppo.datasets import collate_pairs
    from openppo.models.actor import Actor
    from openppo.models.hf import load_tokenizer, resolve_model_path
    from openppo.trainers import setup
    from openppo.trainers.loop import SupervisedTrainer
    from openppo.trainers.stages import DPOTrainer

    setup.validate_common(cfg)
    ref_path = cfg.dpo.ref_pretrain or cfg.model.pretrain
    resolve_model_path(ref_path, "--ref_pretrain")
    require(cfg.dpo.beta > 0, f"--beta must be positive, got {cfg.dpo.beta}")
    require(
        0.0 <= cfg.dpo.label_smoothing < 0.5, f"--label_smoothing must be in [0, 0.5), got {cfg.dpo.label_smoothing}"
    )
    require(
        not (cfg.dpo.ipo and cfg.dpo.label_smoothing > 0),
        "--label_smoothing is cDPO's and the --ipo loss does not use it: drop one of them",
    )
    require(cfg.dpo.nll_loss_coef >= 0, f"--nll_loss_coef must be >= 0 (0 = off), got {cfg.dpo.nll_loss_coef}")
    raw_train, raw_eval = setup.load_raw_data(cfg.data, preference_keys(cfg), cfg.optim.seed)
    tokenizer = load_tokenizer(
        cfg.model.pretrain,
        chat_template=cfg.data.tokenizer_chat_template,
        use_fast=not cfg.data.disable_fast_tokenizer,
    )
    train_ds, eval_ds = build_preference_data(cfg, tokenizer, raw_train, raw_eval)
    strategy = setup.make_strategy(cfg)
    with strategy.zero3_init(for_training=False, offload=cfg.dpo.ref_offload):
        ref = Actor.from_pretrained(
            ref_path,
            dtype=strategy.torch_dtype,
            flag="--ref_pretrain",
            attn_implementation=cfg.model.attn_implementation,
            **cfg.model.kernel_kwargs(),
        )
    setup.set_layout(cfg, ref)
    ref_engine = strategy.prepare_eval(ref, offload=cfg.dpo.ref_offload)
    with strategy.zero3_init():
        actor = Actor.from_pretrained(cfg.model.pretrain, dtype=strategy.torch_dtype, **cfg.model.build_kwargs())
    setup.set_layout(cfg, actor)
    steps = SupervisedTrainer.num_training_steps(len(train_ds), cfg.optim)
    engine = strategy.prepare_train(actor, **setup.optimizer_kwargs(cfg, steps))
    tracker = setup.make_tracker(cfg, strategy, "train_dpo")
    collate = functools.partial(collate_pairs, pad_token_id=tokenizer.pad_token_id)
    try:
        DPOTrainer(
            ref_engine=ref_engine,
            beta=cfg.dpo.beta,
            label_smoothing=cfg.dpo.label_smoothing,
            ipo=cfg.dpo.ipo,
            nll_loss_coef=cfg.dpo.nll_loss_coef,
            **setup.train_kwargs(cfg, strategy, engine, tokenizer, train_ds, eval_ds, collate, tracker),
        ).fit()
    finally:
        tracker.close()


def main(argv=None) -> int:
    return run_cli(train, DPOConfig, "openppo.cli.train_dpo", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
