"""How every CLI runs: parse the typed config, run, turn user errors into one line and exit code 2, and a failed
rank or engine into its diagnosis (no driver traceback) and exit code 1."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from openppo.config.schema import parse_config
from openppo.errors import RunFailure, UserError
from openppo.utils.tracking import setup_logging

C = TypeVar("C")


def run_cli(
    main: Callable[[C], None], config_cls: type[C], prog: str, description: str, argv: Sequence[str] | None = None
) -> int:
    setup_logging()
    cfg = parse_config(config_cls, argv, prog, description)
    try:
        ds = getattr(cfg, "ds", None)
        if ds is not None and hasattr(ds, "param_dtype") and not getattr(config_cls, "precision_on_cluster", False):
            # --param_dtype auto becomes bf16 or fp32 here, once, before anything reads or logs the config
            from openppo.utils.hardware import resolve_precision

            resolve_precision(ds)
        main(cfg)
    except UserError as err:
        # Every rank fails the same way; one line from rank 0 is enough.
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"error: {err}\n")
        return 2
    except RunFailure as err:
        sys.stderr.write(f"error: {err}\n")
        return 1
    return 0
