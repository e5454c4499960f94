"""Reading one local data source into a `datasets.Dataset`.

A source is a data file (.json, .jsonl, .parquet, .csv), a folder written by `Dataset.save_to_disk` or
`DatasetDict.save_to_disk`, or a folder of data files of one type. Hub names are refused on purpose: training
runs on machines without a hub, and a typo in a path should fail here with the path in the message rather
than as a download error.
"""

from __future__ import annotations

import logging
from pathlib import Path

import datasets

from openppo.errors import UserError

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
        reason = _first_line(_root_cause(err))
        raise UserError(f"{flag}: cannot read '{source}' as {builder} ({reason}); fix the file or its suffix") from err
    finally:
        library_logger.setLevel(level)


def _root_cause(err: BaseException) -> BaseException:
    # `datasets` wraps the parser's error ("JSON parse error: ... in row 1") in a generic DatasetGenerationError.
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
