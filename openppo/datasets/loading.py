"""`--dataset a.jsonl,b.parquet --dataset_probs 0.7,0.3`: load local sources and mix them into one Dataset.

Mixing rules:
* one source is returned as is (its probability, if given, is only checked);
* several sources without probabilities are concatenated: every row is used exactly once;
* several sources with probabilities are interleaved at random (`stopping_strategy="all_exhausted"`: a small
  source is repeated until the largest one has been seen once). A source of probability 0 is left out, since
  `datasets` cannot exhaust a source it never samples.
Sources whose columns differ are cut down to the columns they share (logged), and `max_samples` truncates
after mixing, so the mix proportions hold for the truncated set too.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import datasets

from openppo.datasets.sources import read_source
from openppo.errors import UserError, require

logger = logging.getLogger(__name__)


def load_blended_dataset(
    spec: str,
    probs: str | None = None,
    *,
    flag: str = "--dataset",
    probs_flag: str = "--dataset_probs",
    seed: int = 42,
    max_samples: int | None = None,
    split: str = "train",
    split_flag: str = "--dataset_split",
) -> datasets.Dataset:
    """Load the comma-separated local sources of `spec` and mix them (see the module docstring). `split` picks the
    split of a source that is a `save_to_disk` DatasetDict folder (files have one split)."""
    sources = parse_sources(spec, flag)
    weights = parse_probs(probs, len(sources), probs_flag=probs_flag, flag=flag) if probs else None
    with _quiet_progress_bars():
        parts = [read_source(s, flag=flag, split=split, split_flag=split_flag) for s in sources]
        if len(parts) == 1:
            ds = parts[0]
        else:
            parts = _common_columns(parts, sources, flag)
            ds = _mix(parts, sources, weights, seed=seed, flag=flag)
    if max_samples is not None:
        require(max_samples > 0, f"--max_samples must be positive, got {max_samples}")
        ds = ds.select(range(min(max_samples, len(ds))))
    if len(ds) == 0:
        raise UserError(f"{flag}: no rows left after mixing {spec}; check the sources and {probs_flag}")
    logger.info("%s: %d rows from %s", flag, len(ds), ", ".join(sources))
    return ds


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    # `datasets` draws a progress bar on stderr for every file it converts and every cast; on bad input the
    # CLI's contract is a single error line there, so the bars are off while loading (restored afterwards).
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def parse_sources(spec: str, flag: str) -> list[str]:
    sources = [s.strip() for s in (spec or "").split(",") if s.strip()]
    require(bool(sources), f"{flag} is empty; pass a comma list of local data files or save_to_disk folders")
    return sources


def parse_probs(probs: str, num_sources: int, *, probs_flag: str, flag: str) -> list[float]:
    """Normalized sampling probabilities, one per source."""
    try:
        values = [float(p) for p in probs.split(",") if p.strip()]
    except ValueError:
        raise UserError(f"{probs_flag}: '{probs}' is not a comma list of numbers; pass e.g. 0.7,0.3") from None
    require(
        len(values) == num_sources,
        f"{probs_flag}: got {len(values)} probabilities for {num_sources} {flag} sources; pass one per source",
    )
    require(
        all(v >= 0 for v in values) and sum(values) > 0,
        f"{probs_flag}: '{probs}' must be non-negative numbers with a positive sum",
    )
    total = sum(values)
    return [v / total for v in values]


def require_columns(ds: datasets.Dataset, keys: dict[str, str | None], source: str) -> None:
    """Check that every column named in `keys` (flag name -> column name; None = unused) exists in `ds`."""
    columns = list(ds.column_names)
    for key_flag, column in keys.items():
        if column is not None and column not in columns:
            raise UserError(
                f"{key_flag}: column '{column}' not found in {source} (columns: {', '.join(columns)}); "
                f"pass {key_flag} with one of those"
            )


def _common_columns(parts: list[datasets.Dataset], sources: list[str], flag: str) -> list[datasets.Dataset]:
    shared = [c for c in parts[0].column_names if all(c in p.column_names for p in parts[1:])]
    require(bool(shared), f"{flag}: the sources {', '.join(sources)} share no column; give them the same keys")
    out = []
    for part, source in zip(parts, sources):
        extra = [c for c in part.column_names if c not in shared]
        if extra:
            logger.info("%s: dropping columns %s of %s that the other sources lack", flag, extra, source)
            part = part.select_columns(shared)
        out.append(part)
    return out


def _mix(
    parts: list[datasets.Dataset], sources: list[str], weights: list[float] | None, *, seed: int, flag: str
) -> datasets.Dataset:
    if weights is not None:
        kept = [i for i, w in enumerate(weights) if w > 0]
        skipped = [sources[i] for i in range(len(sources)) if weights[i] == 0]
        if skipped:
            logger.info("%s: skipping sources with probability 0: %s", flag, ", ".join(skipped))
        parts, sources, weights = [parts[i] for i in kept], [sources[i] for i in kept], [weights[i] for i in kept]
        if len(parts) == 1:
            return parts[0]
    parts = _same_features(parts, sources, flag)
    if weights is None:
        return datasets.concatenate_datasets(parts)
    return datasets.interleave_datasets(parts, probabilities=weights, seed=seed, stopping_strategy="all_exhausted")


def _same_features(parts: list[datasets.Dataset], sources: list[str], flag: str) -> list[datasets.Dataset]:
    # Arrow needs one schema for the mix: cast later sources to the first one's column types when they differ
    # (e.g. an int column read from csv as int64 and from json as float64).
    out = [parts[0]]
    for part, source in zip(parts[1:], sources[1:]):
        if part.features != parts[0].features:
            try:
                part = part.cast(parts[0].features)
            except Exception as err:  # any cast failure means the sources disagree on a column's type
                differ = [c for c in part.column_names if part.features[c] != parts[0].features[c]]
                raise UserError(
                    f"{flag}: columns {differ} of {source} have other types than in {sources[0]}; "
                    f"make the sources agree"
                ) from err
        out.append(part)
    return out
