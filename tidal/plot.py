"""``tidal plot``: learning curves from run folders' ``metrics.jsonl``, several runs overlaid,
one subplot per metric, written as a PNG."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

EVAL_KEYS = ("eval/return_mean", "eval/accuracy", "eval/success_rate")
TRAIN_KEYS = ("rollout/return_mean", "rollout/reward_mean")
X_COLUMNS = {"step": "step", "env_steps": "env_steps", "time": "time/elapsed"}
X_LABELS = {"step": "training step", "env_steps": "environment steps", "time": "elapsed time (s)"}


class PlotError(ValueError):
    """Bad input to ``tidal plot``; the message says what exists instead."""


def load_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of ``<run_dir>/metrics.jsonl``. A torn last line (a run that crashed while
    writing) is skipped; any other line that is not a JSON object is an error."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(_no_metrics_message(run_dir))
    lines = path.read_text().splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise PlotError(f"{path}:{number}: not a JSON row: {line[:80]!r}") from None
        if not isinstance(row, dict):
            raise PlotError(f"{path}:{number}: expected a JSON object, got {line[:80]!r}")
        rows.append(row)
    if not rows:
        raise PlotError(f"{path} has no rows yet")
    return rows


def _no_metrics_message(run_dir: Path) -> str:
    if not run_dir.is_dir():
        return f"{run_dir}: no such run folder"
    runs = sorted(p.name for p in run_dir.iterdir() if (p / "metrics.jsonl").is_file())
    if runs:
        return f"{run_dir} has no metrics.jsonl; run folders inside it: {', '.join(runs)}"
    contents = sorted(p.name for p in run_dir.iterdir())
    return f"{run_dir} has no metrics.jsonl (it holds: {', '.join(contents) or 'nothing'})"


def numeric_keys(rows: list[dict]) -> set[str]:
    """Keys with at least one finite number (``step`` included)."""
    return {k for row in rows for k, v in row.items() if _is_number(v)}


def default_keys(available: set[str]) -> list[str]:
    """The evaluation metric and the training return or reward, those that exist."""
    keys = [next((k for k in group if k in available), None) for group in (EVAL_KEYS, TRAIN_KEYS)]
    keys = [k for k in keys if k is not None]
    if not keys:
        raise PlotError(
            f"none of the default keys ({', '.join(EVAL_KEYS + TRAIN_KEYS)}) is in "
            f"the metrics; pass --keys from: {_listing(available)}"
        )
    return keys


def curve(rows: list[dict], x_column: str, key: str) -> tuple[list[float], list[float]]:
    """The (x, y) points of rows that have both as finite numbers. The evaluation before the
    first step (step 0) counts no env steps and no time yet: it is plotted at 0."""
    points = [
        (row.get(x_column, 0 if row.get("step") == 0 else None), row[key])
        for row in rows
        if _is_number(row.get(key))
    ]
    points = [p for p in points if _is_number(p[0])]
    return [p[0] for p in points], [p[1] for p in points]


def plot_runs(
    runs: Sequence[str | Path],
    keys: Sequence[str] | None = None,
    x: str = "step",
    out: str | Path | None = None,
) -> Path:
    """Plot ``keys`` (default: see ``default_keys``) of each run against ``x`` (``step``,
    ``env_steps`` or ``time``) into ``out`` (default ``<first run>/plots/curves.png``)."""
    if not runs:
        raise PlotError("no run folders given")
    if x not in X_COLUMNS:
        raise PlotError(f"-x: expected one of {', '.join(X_COLUMNS)}, got {x!r}")
    runs = [Path(r) for r in runs]
    data = {run: load_metrics(run) for run in runs}
    available = set().union(*(numeric_keys(rows) for rows in data.values()))
    keys = list(keys) if keys else default_keys(available)
    unknown = [k for k in keys if k not in available]
    if unknown:
        raise PlotError(
            f"unknown key(s) {', '.join(unknown)}; keys in the metrics: {_listing(available)}"
        )
    x_column = X_COLUMNS[x]
    for run, rows in data.items():
        if x_column not in numeric_keys(rows):
            raise PlotError(f"-x {x}: {run}/metrics.jsonl has no {x_column!r} column")
    out = Path(out) if out else runs[0] / "plots" / "curves.png"
    _check_image_type(out)
    _draw(dict(zip(_labels(runs), data.values())), keys, x, out)
    return out


def _draw(data: dict[str, list[dict]], keys: list[str], x: str, out: Path) -> None:
    # The Figure API, not pyplot: no global state, no GUI backend, safe off the main thread.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.2 * len(keys)), layout="constrained")
    axes = fig.subplots(len(keys), 1, sharex=True, squeeze=False)[:, 0]
    for ax, key in zip(axes, keys):
        for index, (label, rows) in enumerate(data.items()):
            xs, ys = curve(rows, X_COLUMNS[x], key)
            if xs:  # a run keeps its colour in every subplot, even where another run has no curve
                ax.plot(
                    xs,
                    ys,
                    label=label,
                    color=f"C{index % 10}",
                    marker="o" if len(xs) <= 30 else None,
                    markersize=3,
                )
        ax.set_title(key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[-1].set_xlabel(X_LABELS[x])
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)


def _check_image_type(out: Path) -> None:
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    if out.suffix.lstrip(".").lower() not in kinds:
        raise PlotError(
            f"-o {out}: the name must end in an image type: .{', .'.join(sorted(kinds))}"
        )


def _labels(runs: list[Path]) -> list[str]:
    """Folder names, or the paths as given where two folders share a name."""
    names = [run.resolve().name for run in runs]
    return [name if names.count(name) == 1 else str(run) for name, run in zip(names, runs)]


def _listing(keys: set[str]) -> str:
    return ", ".join(sorted(keys)) or "none"


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# -- the command --------------------------------------------------------------------------------


def add_plot_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``tidal plot`` on the CLI's subparsers; its handler is ``args.fn``."""
    p = subparsers.add_parser("plot", help="learning curves of one or more runs, as a PNG")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders holding metrics.jsonl")
    p.add_argument(
        "--keys",
        nargs="+",
        metavar="K",
        help="metrics to plot (default: the evaluation metric and the training return or reward)",
    )
    p.add_argument("-x", choices=list(X_COLUMNS), default="step", help="the x axis")
    p.add_argument(
        "-o",
        "--out",
        metavar="FILE.png",
        help="output file (default: <first run>/plots/curves.png)",
    )
    p.set_defaults(fn=plot_command)
    return p


def plot_command(args: argparse.Namespace) -> int:
    try:
        out = plot_runs(args.runs, args.keys, args.x, args.out)
    except (PlotError, OSError) as exc:
        print(f"tidal: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0
