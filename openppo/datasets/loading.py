"""Local data for every trainer: reading one source into a `datasets.Dataset`, and mixing several.

`--dataset a.jsonl,b.parquet --dataset_probs 0.7,0.3`.

A source is a data file (.json, .jsonl, .parquet, .csv), a folder written by `Dataset.save_to_disk` or
`DatasetDict.save_to_disk`, or a folder of data files of one type. Hub names are refused on purpose: training
runs on machines without a hub, and a typo in a path should fail here with the path in the message rather
than as a download error.

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
from pathlib import Path

import datasets

from openppo.errors import UserError, headline, require

logger = logging.getLogger(__name__)

# -- one source -------------------------------------------------------------------------------------------------------
# File suffix -> `datasets` builder name. JSON lists and JSON lines both go through the "json" builder.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
_KINDS = "a local .json/.jsonl/.parquet/.csv file or a datasets.save_to_disk folder"


def read_source(
    source: str, *, flag: str, split: str = "train", split_flag: str = "--dataset_split"
) -> datasets.Dataset:
    """The rows of one source; raises UserError naming `flag` when it is missing, unreadable or empty."""
    path = Path(source).expanduser()
    if path.is_file():
        ds = _read_files([path], source=source, flag=flag)
    elif path.is_dir():
        ds = _read_folder(path, source=source, flag=flag, split=split, split_flag=split_flag)
    else:
        raise UserError(f"{flag}: '{source}' not found; pass {_KINDS}")
    if len(ds) == 0:
        raise UserError(f"{flag}: '{source}' has no rows; pass a source with data")
    return ds


def _read_folder(path: Path, *, source: str, flag: str, split: str, split_flag: str) -> datasets.Dataset:
    # save_to_disk writes dataset_dict.json for a DatasetDict and state.json for a single Dataset.
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise UserError(
                    f"{flag}: '{source}' has no split '{split}' (splits: {', '.join(loaded)}); "
                    f"pass {split_flag} with one of those splits"
                )
            return loaded[split]
        return loaded
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in FILE_BUILDERS)
    if not files:
        raise UserError(
            f"{flag}: folder '{source}' holds no .json/.jsonl/.parquet/.csv files and was not "
            f"written by save_to_disk; pass {_KINDS}"
        )
    builders = {FILE_BUILDERS[p.suffix.lower()] for p in files}
    if len(builders) > 1:
        raise UserError(
            f"{flag}: folder '{source}' mixes file types ({', '.join(sorted(builders))}); "
            f"pass the files as a comma list instead"
        )
    return _read_files(files, source=source, flag=flag)


def _read_files(files: list[Path], *, source: str, flag: str) -> datasets.Dataset:
    builder = FILE_BUILDERS.get(files[0].suffix.lower())
    if builder is None:
        raise UserError(f"{flag}: '{source}' has an unsupported suffix '{files[0].suffix}'; pass {_KINDS}")
    # The json builder fails on an empty file with an unhelpful StopIteration, so leave empty files out.
    files = [f for f in files if f.stat().st_size > 0]
    if not files:
        raise UserError(f"{flag}: '{source}' is empty; pass a source with data")
    # The builders log their own parse errors on stderr before raising; the message below says it in one line.
    library_logger = logging.getLogger("datasets")
    level = library_logger.level
    library_logger.setLevel(logging.CRITICAL)
    try:
        return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")
    except Exception as err:  # any parse error of the user's file becomes a one-line message
        # `datasets` reports a file without rows (a JSON `[]`, a parquet of 0 rows) as a split with no data.
        if "corresponds to no data" in str(err):
            raise UserError(f"{flag}: '{source}' has no rows; pass a source with data") from err
        cause = _root_cause(err)
        reason = headline(cause, type(cause).__name__)
        raise UserError(f"{flag}: cannot read '{source}' as {builder} ({reason}); fix the file or its suffix") from err
    finally:
        library_logger.setLevel(level)


def _root_cause(err: BaseException) -> BaseException:
    # `datasets` wraps the parser's error ("JSON parse error: ... in row 1") in a generic DatasetGenerationError.
    while err.__cause__ is not None:
        err = err.__cause__
    return err


# -- mixing -----------------------------------------------------------------------------------------------------------


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
