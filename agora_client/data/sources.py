"""Where documents come from: a Hugging Face dataset or local files, read through ``datasets`` in streaming mode.

``data.source`` in the run config (or ``trainer --data``) is one of:
  None                         the Python standard library's source, present on every machine (the demo)
  a .txt / .jsonl / .parquet   file, or a folder of them (a .txt file is one document)
  a folder with a README.md    a dataset laid out like a hub repo (configs in its YAML header)
  <org>/<name>                 a hub dataset, e.g. HuggingFaceFW/fineweb-edu with subset sample-10BT

Every trainer reads only its own shard: whole files when the dataset has at least as many files as there
are trainers (``IterableDataset.shard``), else every n-th example (``split_dataset_by_node``).
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from agora_client.config import DataConfig

LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".parquet": "parquet"}


class DataError(ValueError):
    """The data source cannot be used; the message says why and what to pass instead."""


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    def __post_init__(self):
        if not 0 <= self.index < self.count:
            raise DataError(f"shard {self.index} does not exist among {self.count} trainers")

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(path for path in root.rglob("*.py") if "site-packages" not in path.parts)


def open_split(spec: DataConfig, split: str):
    """The whole split as a streaming ``datasets.IterableDataset``; DataError lists what exists instead."""
    try:
        import datasets
    except ImportError:
        raise DataError("reading data needs the `datasets` package (pip install datasets)") from None
    kind, arguments = _load_arguments(spec, split)
    try:
        return datasets.load_dataset(*arguments["args"], **arguments["kwargs"], split=split, streaming=True)
    except ValueError as error:  # unknown config or split: datasets names the ones that exist
        raise DataError(_what_exists(spec, split, error)) from None
    except datasets.exceptions.DatasetNotFoundError:
        raise DataError(
            f"no dataset {spec.source!r} on the Hugging Face hub (or it is gated: log in with `hf auth login`)"
        ) from None
    except (ConnectionError, OSError) as error:
        if kind != "hub":
            raise DataError(f"could not read {spec.source or 'the standard library'}: {error}") from None
        raise DataError(
            f"could not reach the Hugging Face hub for {spec.source!r} ({error.__class__.__name__}): this "
            "machine looks offline; pass local .txt/.jsonl/.parquet files with --data PATH"
        ) from None


def shard_of(dataset, shard: Shard):
    """This trainer's part of a streaming dataset: disjoint from every other trainer's, together the whole."""
    if shard.count == 1:
        return dataset
    if dataset.num_shards >= shard.count:
        return dataset.shard(num_shards=shard.count, index=shard.index)
    from datasets.distributed import split_dataset_by_node

    return split_dataset_by_node(dataset, rank=shard.index, world_size=shard.count)


def texts_of(dataset, spec: DataConfig) -> Iterator[str]:
    """The text field of every record; DataError, listing the fields there are, if it is missing."""
    field = _text_field(spec)
    known = dataset.features
    if known is not None and field not in known:
        raise DataError(_missing_field(spec, field, list(known)))
    for record in _records(dataset, spec):
        text = record.get(field)
        if not isinstance(text, str):
            if field not in record:
                raise DataError(_missing_field(spec, field, list(record)))
            continue  # a null text: nothing to train on
        yield text


def _records(dataset, spec: DataConfig) -> Iterator[dict[str, Any]]:
    """The dataset's records; a file that cannot be parsed becomes a DataError naming the source."""
    records = iter(dataset)
    while True:
        try:
            record = next(records)
        except StopIteration:
            return
        except (ValueError, OSError) as error:  # pyarrow's parse errors are ValueErrors
            raise DataError(f"{spec.source or 'the standard library'}: a record could not be read ({error})") from None
        yield record


def open_documents(spec: DataConfig, shard: Shard, split: str | None = None) -> Iterator[str]:
    """This shard's documents, in the source's order."""
    return texts_of(shard_of(open_split(spec, split or spec.split), shard), spec)


def _text_field(spec: DataConfig) -> str:
    return "text" if _is_plain_files(spec) else spec.text_field


def _is_plain_files(spec: DataConfig) -> bool:
    """The standard library or .txt files: one document per file, under the field "text"."""
    return (
        spec.source is None
        or Path(spec.source).suffix == ".txt"
        or (Path(spec.source).is_dir() and _suffix_of(_local_files(Path(spec.source))) == ".txt")
    )


def _load_arguments(spec: DataConfig, split: str) -> tuple[str, dict[str, Any]]:
    """(kind, load_dataset arguments) for the source: stdlib, local files, a hub-like folder, or the hub."""
    if spec.source is None:
        files = [str(path) for path in stdlib_files()]
        return "stdlib", {
            "args": ("text",),
            "kwargs": {"data_files": {split: files}, "sample_by": "document", "encoding_errors": "replace"},
        }
    path = Path(spec.source).expanduser()
    if path.is_dir() and (path / "README.md").is_file():
        return "hub-like", {"args": (str(path),), "kwargs": {"name": spec.subset}}
    if path.exists():
        files = _local_files(path)
        suffix = _suffix_of(files)
        extra = {"sample_by": "document", "encoding_errors": "replace"} if suffix == ".txt" else {}
        return "files", {
            "args": (LOCAL_BUILDERS[suffix],),
            "kwargs": {"data_files": {split: [str(f) for f in files]}, **extra},
        }
    if path.suffix in LOCAL_BUILDERS or spec.source.startswith((".", "/", "~")):
        raise DataError(f"{spec.source} does not exist")
    return "hub", {"args": (spec.source,), "kwargs": {"name": spec.subset}}


def _local_files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix not in LOCAL_BUILDERS:
            raise DataError(f"{path}: unsupported file type; use {', '.join(LOCAL_BUILDERS)}")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_BUILDERS)
    if not files:
        raise DataError(f"{path} holds no {', '.join(LOCAL_BUILDERS)} files")
    return files


def _suffix_of(files: list[Path]) -> str:
    suffixes = sorted({file.suffix for file in files})
    if len(suffixes) > 1:
        raise DataError(f"{files[0].parent} mixes {', '.join(suffixes)} files: put one kind in a folder")
    return suffixes[0]


def _what_exists(spec: DataConfig, split: str, error: ValueError) -> str:
    message = str(error)
    if "BuilderConfig" in message or "Config name is missing" in message:
        return f"{spec.source} has no subset {spec.subset!r}: {message.split('Available:', 1)[-1].strip() or message}"
    if "split" in message.lower():
        available = message.split("Available splits:", 1)[-1].strip()
        return f"{spec.source or 'the data'} has no split {split!r}; splits: {available}"
    return f"cannot read {spec.source or 'the standard library'}: {message}"


def _missing_field(spec: DataConfig, field: str, fields: list[str]) -> str:
    return (
        f"{spec.source or 'the data'} has no text field {field!r}; fields: {', '.join(fields) or 'none'} "
        "(set data.text_field, or --text-field)"
    )
