"""Hugging Face ``datasets`` as a source of prompt rows: a ``save_to_disk`` directory, an Arrow file, or a
dataset name (a hub name such as ``openai/gsm8k``, or a local directory of data files).

A name is read from the ``datasets`` cache first, with the library in offline mode, so a machine without
network trains on what an earlier ``load_dataset`` cached (or a cache copied there); only when the cache
does not hold it, and the environment does not forbid the network (``HF_HUB_OFFLINE=1`` or
``HF_DATASETS_OFFLINE=1``), is it downloaded. Rows come out as plain dicts with their 1-based row numbers,
and :mod:`relayrl.data.datasets` checks them exactly as it checks JSONL rows.

Departure from verl and TRL: they read a preprocessed Parquet file (verl) or take a ``Dataset`` object in
Python (TRL); here the config names the source and the split, and no preprocessing script runs first (the
answer is cut out of a solution by ``data.answer_regex``, the system prompt added by ``data.system_prompt``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

from relayrl.data.errors import DatasetError, duplicate_column, missing_column

__all__ = ["INSTALL_HINT", "datasets_installed", "is_datasets_dir", "load_named", "open_dataset", "iter_rows"]

INSTALL_HINT = "pip install 'relayrl[datasets]' (or pip install datasets)"


def datasets_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("datasets") is not None


def _datasets(what: str) -> Any:
    """The ``datasets`` module, or a clear error saying that ``what`` needs it and how to install it."""
    try:
        import datasets
    except ImportError as e:
        raise DatasetError(f"{what} is read with Hugging Face datasets, which is not installed ({e}): "
                           f"{INSTALL_HINT}") from None
    return datasets

_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def is_datasets_dir(path: Path) -> bool:
    """Whether ``path`` is a directory ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` wrote."""
    return path.is_dir() and any((path / m).is_file() for m in _MARKERS)


@contextlib.contextmanager
def _offline(on: bool) -> Iterator[None]:
    """``datasets`` (and the hub client under it) in offline mode for the block: read from the cache only."""
    datasets = _datasets("a dataset")
    import huggingface_hub.constants as hub

    before = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    if on:
        datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = before


def _pick_split(ds: Any, split: str, what: str, key: str) -> Any:
    """One split of a ``DatasetDict`` (a ``Dataset`` is returned as it is)."""
    datasets = _datasets(what)

    if not isinstance(ds, datasets.DatasetDict):
        return ds
    if split not in ds:
        raise DatasetError(f"{what} has splits {', '.join(ds) or 'none'}, not {split!r}: set {key} to one of them")
    return ds[split]


def load_named(name: str, config: str | None, split: str, split_key: str) -> Any:
    """``datasets.load_dataset(name, config, split=split)``: from the cache (offline) first, then from the
    hub unless the environment says offline. Raises a clear error naming ``data.hf_name`` otherwise."""
    datasets = _datasets(f"data.hf_name={name}")

    label = name + (f" ({config})" if config else "")
    try:
        with _offline(True):
            return datasets.load_dataset(name, config, split=split)
    except ValueError as e:
        if "split" in str(e).lower() and "unknown" in str(e).lower():
            raise DatasetError(f"data.hf_name={label}: {e}; set {split_key} to one of its splits") from None
        cached_error: Exception = e
    except (ConnectionError, FileNotFoundError, OSError) as e:
        cached_error = e
    if datasets.config.HF_HUB_OFFLINE:
        raise DatasetError(f"data.hf_name={label}: not found in the datasets cache ({datasets.config.HF_DATASETS_CACHE}) "
                     f"and the environment is offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE): load it once where "
                     f"there is network (datasets.load_dataset({name!r}{f', {config!r}' if config else ''})) and "
                     f"copy that cache here, or save_to_disk and set data.path ({cached_error})") from None
    try:
        return datasets.load_dataset(name, config, split=split)
    except ValueError as e:
        raise DatasetError(f"data.hf_name={label}: {e}") from None
    except (ConnectionError, FileNotFoundError, OSError) as e:
        raise DatasetError(f"data.hf_name={label}: not in the datasets cache ({datasets.config.HF_DATASETS_CACHE}) and "
                     f"not downloadable ({type(e).__name__}: {e}); save it with save_to_disk where there is network "
                     f"and set data.path to that directory") from None


def open_dataset(path: Path | None, name: str | None, config: str | None, split: str,
                 split_key: str = "data.hf_split") -> tuple[Any, str]:
    """``(datasets.Dataset, label)`` of a ``save_to_disk`` directory or an Arrow file (``path``), or of the
    dataset ``name``; ``label`` names the source in row errors (``train.arrow``, ``gsm8k/test``)."""
    datasets = _datasets(f"data.hf_name={name}" if name is not None else f"dataset path {path}")

    if name is not None:
        return load_named(name, config, split, split_key), f"{name}[{split}]"
    assert path is not None
    if path.is_dir():
        if not is_datasets_dir(path):
            raise DatasetError(f"dataset path {path} is not a file, nor a directory datasets' save_to_disk wrote "
                         f"(it has no {', '.join(_MARKERS)}); give a .jsonl/.parquet/.arrow file, such a directory, "
                         f"or a dataset name as data.hf_name")
        try:
            ds = datasets.load_from_disk(str(path))
        except (OSError, ValueError, FileNotFoundError) as e:
            raise DatasetError(f"dataset directory {path}: datasets.load_from_disk failed ({e})") from None
        dict_dir = isinstance(ds, datasets.DatasetDict)
        return _pick_split(ds, split, f"dataset directory {path}", split_key), \
            f"{path.name}/{split}" if dict_dir else path.name
    import contextlib

    with contextlib.suppress(Exception):  # not the streaming format datasets writes: try Arrow's random-access file
        return datasets.Dataset.from_file(str(path)), path.name
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_file(source).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise DatasetError(f"{path.name}: not a readable Arrow file ({e})") from None
    return datasets.Dataset(table), path.name


def iter_rows(ds: Any, label: str, keys: tuple[str, ...], options: dict[str, str] | None = None,
              implicit: tuple[str, str] | None = None) -> Iterator[tuple[int, dict]]:
    """``(row number from 1, row dict)`` of ``ds``; a key whose column the dataset lacks fails at row 1 (every
    row lacks it), with the columns present and the option that names it (``options``: key -> option;
    ``implicit``: the prompt key that an answer column of chat messages makes optional,
    :func:`~relayrl.data.errors.missing_column`)."""
    twice = duplicate_column(ds.features.arrow_schema.names)
    if twice is not None:
        raise DatasetError(f"{label}: {twice}")
    missing = missing_column(ds.features.arrow_schema, keys, options, implicit)
    if missing is not None:
        raise DatasetError(f"{label} row 1: {missing} (the dataset has no such column, so no row has it)")
    for i, row in enumerate(ds, start=1):
        yield i, row
