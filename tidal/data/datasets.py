"""Dataset files for language agents: local JSONL, JSON or Parquet loaded with Hugging Face
``datasets`` (offline, cached in a folder the caller names), checked against the config's keys,
and read in a seeded shuffled order whose position is checkpointed.

Prompt records (RL, evaluation) come out as ``{"prompt", "answer", "id", ...the row's other
fields}``: ``data.prompt_key`` / ``data.answer_key`` are renamed to ``prompt`` / ``answer``; the
prompt is a string or a list of chat messages. Conversation records (SFT) hold ``messages``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from tidal.extras import needs_extra

# before ``datasets`` is imported: it reads these once; a local file never needs the hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# file suffix -> the ``datasets`` builder that reads it
FORMATS: dict[str, str] = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class DataConfigError(ValueError):
    """A dataset file that does not match the config; the message names the config key."""


def load_table(path: str | Path, cache_dir: str | Path, key: str = "data.path"):
    """The file at ``path`` as a ``datasets.Dataset``; its Arrow cache goes in ``cache_dir``."""
    with needs_extra("llm", "dataset files"):
        import datasets

    path = Path(path)
    builder = FORMATS.get(path.suffix.lower())
    if builder is None:
        raise DataConfigError(
            f"{key}: {str(path)!r} is not a dataset file; expected one of {', '.join(FORMATS)}"
        )
    if not path.is_file():
        raise DataConfigError(f"{key}: no such file {str(path)!r}")
    if path.stat().st_size == 0:
        raise DataConfigError(f"{key}: {str(path)!r} holds no records")
    datasets.config.HF_HUB_OFFLINE = True  # in case ``datasets`` was imported before this module
    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(
            builder, data_files=str(path), split="train", cache_dir=str(cache_dir)
        )
    except Exception as exc:  # malformed JSON, mixed column types, a corrupt Parquet file, ...
        if "corresponds to no data" in str(exc):  # how ``datasets`` says "[]"
            raise DataConfigError(f"{key}: {str(path)!r} holds no records") from None
        raise DataConfigError(
            f"{key}: cannot read {str(path)!r} as {builder}: {type(exc).__name__}: {exc}"
        ) from exc
    if len(table) == 0:
        raise DataConfigError(f"{key}: {str(path)!r} holds no records")
    return table


def _require_column(table, column: str, key: str, path: str | Path) -> None:
    if column not in table.column_names:
        raise DataConfigError(
            f"{key}: {str(path)!r} has no field {column!r}; its fields: "
            f"{', '.join(table.column_names)}"
        )
    nulls = table.data.column(column).null_count
    if nulls:
        raise DataConfigError(
            f"{key}: field {column!r} is empty in {nulls} of {len(table)} records of {str(path)!r}"
        )


def _is_string(feature) -> bool:
    with needs_extra("llm", "dataset files"):
        import datasets

    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")


def _is_messages(feature) -> bool:
    """A list of ``{role, content}`` structs (a chat conversation), or of JSON objects: datasets
    keeps messages of differing shapes (tool calls beside plain turns) as JSON, checked message
    by message when they are rendered."""
    with needs_extra("llm", "dataset files"):
        import datasets

    inner = getattr(feature, "feature", None)
    if not isinstance(feature, datasets.List | datasets.LargeList):
        return False
    if isinstance(inner, getattr(datasets, "Json", ())):
        return True
    return (
        isinstance(inner, dict)
        and _is_string(inner.get("role"))
        and _is_string(inner.get("content"))
    )


def _rename(table, source: str, target: str, key: str, path) -> Any:
    if source == target:
        return table
    if target in table.column_names:
        raise DataConfigError(
            f"{key}: {str(path)!r} has both {source!r} and {target!r}; "
            f"rename one, or set {key}: {target}"
        )
    return table.rename_column(source, target)


def _with_ids(table, id_key: str, path):
    """An ``id`` per record (for logs and evaluation rows): the ``id_key`` field, else the row
    index."""
    if id_key in table.column_names:
        return _rename(table, id_key, "id", "data.id_key", path)
    if "id" in table.column_names:
        return table
    return table.add_column("id", list(range(len(table))))


def load_prompts(
    path: str | Path,
    cache_dir: str | Path,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    id_key: str = "id",
    key: str = "data.path",
):
    """Single-turn records: ``prompt`` (a string or chat messages), ``answer`` (when
    ``answer_key`` is set), ``id`` and the row's other fields. ``key`` names the path's config key
    (``data.path`` or ``data.eval_path``) in errors."""
    table = load_table(path, cache_dir, key)
    _require_column(table, prompt_key, "data.prompt_key", path)
    feature = table.features[prompt_key]
    if not (_is_string(feature) or _is_messages(feature)):
        raise DataConfigError(
            f"data.prompt_key: field {prompt_key!r} of {str(path)!r} holds {feature}; "
            "expected a string or a list of chat messages ({role, content})"
        )
    table = _rename(table, prompt_key, "prompt", "data.prompt_key", path)
    if answer_key is not None:
        _require_column(table, answer_key, "data.answer_key", path)
        table = _rename(table, answer_key, "answer", "data.answer_key", path)
    return _with_ids(table, id_key, path)


def load_conversations(
    path: str | Path,
    cache_dir: str | Path,
    messages_key: str = "messages",
    id_key: str = "id",
    key: str = "data.path",
):
    """SFT records: ``messages`` (a list of ``{role, content}``), ``id`` and the row's other
    fields."""
    table = load_table(path, cache_dir, key)
    _require_column(table, messages_key, "data.messages_key", path)
    if not _is_messages(table.features[messages_key]):
        raise DataConfigError(
            f"data.messages_key: field {messages_key!r} of {str(path)!r} holds "
            f"{table.features[messages_key]}; expected a list of chat messages "
            "({role, content})"
        )
    table = _rename(table, messages_key, "messages", "data.messages_key", path)
    return _with_ids(table, id_key, path)


def check_prompts(path: str | Path, **keys) -> int:
    """Validate a prompt file before the run folder exists (its cache is thrown away); the
    number of records. ``keys`` are :func:`load_prompts`'s."""
    with tempfile.TemporaryDirectory(prefix="tidal-data-check-") as cache:
        return len(load_prompts(path, cache, **keys))


def check_conversations(path: str | Path, **keys) -> int:
    """:func:`check_prompts` for an SFT file (``keys`` are :func:`load_conversations`'s)."""
    with tempfile.TemporaryDirectory(prefix="tidal-data-check-") as cache:
        return len(load_conversations(path, cache, **keys))


class RecordIterator:
    """Endless records in a shuffled order (a new permutation each epoch, drawn from ``seed`` and
    the epoch), with a position that :meth:`state_dict` / :meth:`load_state_dict` checkpoint."""

    def __init__(self, table, seed: int, shuffle: bool = True):
        self.table, self.seed, self.shuffle = table, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.table))
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.table))

    def __iter__(self) -> RecordIterator:
        return self

    def __next__(self) -> dict:
        if self.position == len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation()
        record = self.table[int(self._order[self.position])]
        self.position += 1
        return record

    def next_batch(self, n: int) -> list[dict]:
        return [next(self) for _ in range(n)]

    def state_dict(self, unread: int = 0) -> dict:
        """The position; ``unread``: as if the last ``unread`` records had not been read (those
        a checkpoint's batches have not used yet: a resume reads them again)."""
        epoch, position = self.epoch, self.position - unread
        while position < 0 and epoch > 0:  # the permutations are seeded: earlier epochs come back
            epoch, position = epoch - 1, position + len(self.table)
        if position < 0:
            raise ValueError(f"unread: {unread} records, but only {self.read} were read")
        return {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": epoch,
            "position": position,
            "size": len(self.table),
        }

    @property
    def read(self) -> int:
        """Records read so far, over every epoch."""
        return self.epoch * len(self.table) + self.position

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != len(self.table):
            raise DataConfigError(
                f"data.path: the checkpointed position is for {state['size']} records, "
                f"the dataset now has {len(self.table)}; did the file change?"
            )
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation()
