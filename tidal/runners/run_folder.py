"""The run folder every command writes: ``run_dir/<experiment>`` for ``tidal train``,
``<experiment>-sft`` and ``<experiment>-eval`` for ``tidal sft`` and ``tidal eval`` (suffixed
``-2``, ``-3``, ... when that exists), holding the resolved ``config.yaml`` and the command's log
(``train.log``, ``sft.log``, ``eval.log``) besides what the command itself writes.

A resumed run continues in the folder that holds its checkpoint; a run restarted after a worker
fault (``runner.max_restarts``) before its first checkpoint continues in the folder it had.
"""

from __future__ import annotations

import logging
import logging.handlers
from pathlib import Path
from typing import Any

from tidal.checkpoint import clean_stale, complete_checkpoints, resolve_checkpoint
from tidal.config import to_yaml

log = logging.getLogger("tidal.train")


class RunFolder:
    """An open run folder: ``path``, with the ``tidal`` loggers copied to its log file until
    ``close``."""

    def __init__(
        self,
        cfg: Any,
        command: str = "train",
        checkpoint: Path | None = None,
        continue_in: Path | None = None,
    ):
        self.path = folder_for(cfg.runner, command, checkpoint, continue_in)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "config.yaml").write_text(to_yaml(cfg))
        self._handler = attach_file_log(self.path / f"{command}.log")

    def close(self) -> None:
        logging.getLogger("tidal").removeHandler(self._handler)
        self._handler.close()

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def folder_for(
    runner, command: str, checkpoint: Path | None, continue_in: Path | None = None
) -> Path:
    """The checkpoint's folder, else ``continue_in``, else the next free name for the command."""
    if checkpoint is not None:
        clean_stale(checkpoint.parent)
        return checkpoint.parent.parent
    if continue_in is not None:
        return Path(continue_in)
    name = runner.experiment if command == "train" else f"{runner.experiment}-{command}"
    base = Path(runner.run_dir) / name
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def find_resume_checkpoint(runner) -> Path | None:
    """``runner.resume_from``: a checkpoint, a ``checkpoints/`` folder, or ``auto`` (the newest
    complete checkpoint among the experiment's run folders; None when there is none)."""
    if runner.resume_from is None:
        return None
    if runner.resume_from != "auto":
        named = Path(runner.resume_from)
        for folder in (named, named.parent):  # a checkpoints/ folder, or a step_* one's
            clean_stale(folder)  # first: it may move back a checkpoint a killed save moved aside
        return resolve_checkpoint(named)
    base = Path(runner.run_dir)
    found = []
    for folder in base.glob(f"{runner.experiment}*"):
        if folder.name == runner.experiment or _is_suffixed(folder.name, runner.experiment):
            clean_stale(folder / "checkpoints")
            found += complete_checkpoints(folder / "checkpoints")
    if not found:
        log.info(
            "runner.resume_from=auto: no checkpoint of %r under %s; starting fresh",
            runner.experiment,
            base,
        )
        return None
    return max(found, key=lambda p: p.stat().st_mtime)


def _is_suffixed(name: str, experiment: str) -> bool:
    rest = name[len(experiment) :]
    return rest.startswith("-") and rest[1:].isdigit()


LOG_MAX_BYTES = 100 * 2**20  # a week-long run's log: rotated, the newest 400 MB kept
LOG_BACKUPS = 3


def attach_file_log(path: Path) -> logging.Handler:
    """Send the ``tidal`` loggers to a run's log file as well: ``train.log`` rotates to
    ``train.log.1`` .. ``.3`` past 100 MB (a step's line is ~100 bytes; a fast run writes MBs an
    hour), so a run of weeks cannot fill the disk with its log."""
    handler = logging.handlers.RotatingFileHandler(
        path, maxBytes=LOG_MAX_BYTES, backupCount=LOG_BACKUPS
    )
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("tidal")
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    return handler
