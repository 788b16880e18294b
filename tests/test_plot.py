"""``tidal plot``: curves from real metrics.jsonl files into a PNG, and its error messages."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tidal.plot import PlotError, add_plot_parser, curve, plot_runs


def _write_run(path: Path, slope: float, eval_every: int = 5, steps: int = 40) -> Path:
    path.mkdir(parents=True)
    rows = []
    for step in range(steps):
        row = {
            "step": step,
            "env_steps": 512 * (step + 1),
            "time/elapsed": 0.7 * step,
            "rollout/return_mean": slope * step + np.sin(step),
            "loss": 1.0 / (step + 1),
        }
        if step % eval_every == 0:
            row["eval/return_mean"] = slope * step
        rows.append(json.dumps(row))
    (path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture
def runs(tmp_path):
    return [_write_run(tmp_path / "cartpole-a", 5.0), _write_run(tmp_path / "cartpole-b", 3.0)]


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tidal")
    add_plot_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.fn(args)


def test_two_runs_make_a_png_in_the_first_run(runs, capsys):
    assert _cli(["plot", str(runs[0]), str(runs[1]), "-x", "env_steps"]) == 0
    out = runs[0] / "plots" / "curves.png"
    assert capsys.readouterr().out.strip() == str(out)
    with Image.open(out) as image:
        assert image.format == "PNG"
        width, height = image.size
        pixels = np.asarray(image.convert("L"), dtype=float)
    assert (width, height) == (800, 640)  # 8 x 3.2 in per subplot at 100 dpi; two default keys
    assert pixels.std() > 5  # not a blank canvas


def test_chosen_keys_time_axis_and_output_file(runs, tmp_path):
    out = plot_runs(runs, keys=["loss"], x="time", out=tmp_path / "out" / "loss.png")
    assert out == tmp_path / "out" / "loss.png"
    with Image.open(out) as image:
        assert image.size == (800, 320)


def test_the_evaluation_before_training_is_plotted_at_zero_time_and_env_steps():
    """The runner logs its step-0 evaluation alone (no env steps, no elapsed time yet)."""
    rows = [
        {"step": 0, "eval/success_rate": 0.4},
        {"step": 10, "env_steps": 1000, "time/elapsed": 60.0, "eval/success_rate": 0.5},
        {"step": 11, "eval/success_rate": 0.6},  # a later row without x stays out
    ]
    for x_column in ("time/elapsed", "env_steps"):
        assert curve(rows, x_column, "eval/success_rate")[1] == [0.4, 0.5]
    assert curve(rows, "time/elapsed", "eval/success_rate")[0] == [0, 60.0]


def test_a_torn_last_line_is_skipped(tmp_path):
    run = _write_run(tmp_path / "crashed", 1.0)
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 40, "eval/ret')
    assert plot_runs([run]).is_file()


def test_errors_name_what_exists(runs, tmp_path, capsys):
    with pytest.raises(
        PlotError,
        match=r"unknown key\(s\) eval/acc; keys in the metrics: env_steps, "
        r"eval/return_mean, loss, rollout/return_mean, step, time/elapsed",
    ):
        plot_runs(runs, keys=["loss", "eval/acc"])
    with pytest.raises(PlotError, match="run folders inside it: cartpole-a, cartpole-b"):
        plot_runs([tmp_path])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.yaml").write_text("a: 1\n")
    with pytest.raises(PlotError, match=r"empty has no metrics.jsonl \(it holds: config.yaml\)"):
        plot_runs([tmp_path / "empty"])
    with pytest.raises(PlotError, match="no such run folder"):
        plot_runs([tmp_path / "missing"])
    (tmp_path / "llm").mkdir()
    (tmp_path / "llm" / "metrics.jsonl").write_text('{"step": 0, "rollout/reward_mean": 0.5}\n')
    with pytest.raises(PlotError, match=r"-x env_steps: .*llm/metrics.jsonl has no 'env_steps'"):
        plot_runs([runs[0], tmp_path / "llm"], x="env_steps")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    with pytest.raises(PlotError, match="none of the default keys.*pass --keys from: loss, step"):
        plot_runs([tmp_path / "other"])
    with pytest.raises(PlotError, match="must end in an image type"):
        plot_runs(runs, out=tmp_path / "curves.txt")

    assert _cli(["plot", str(runs[0]), "--keys", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tidal: unknown key(s) nope; keys in the metrics:") and "loss" in err
    assert not (runs[0] / "plots").exists()


def test_same_folder_names_are_told_apart(tmp_path):
    a, b = _write_run(tmp_path / "x" / "run", 1.0), _write_run(tmp_path / "y" / "run", 2.0)
    from tidal.plot import _labels

    assert _labels([a, b]) == [str(a), str(b)]
    assert _labels([a]) == ["run"]
