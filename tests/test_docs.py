"""The documents a user reads: sizes, the generated config reference, links and commands."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from tidal import cli
from tidal.config import field_help

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = "tidal config --markdown > docs/config.md"
CONFIG_COMMANDS = ("train", "sft", "eval", "config")  # those that take a config file


@pytest.mark.parametrize(("name", "limit"), [("README.md", 10_000), ("BENCHMARKS.md", 20_000)])
def test_documents_stay_short(name, limit):
    size = len((ROOT / name).read_bytes())
    assert size <= limit, f"{name} is {size} bytes, over {limit}: move history to benchmarks/notes/"


def test_committed_config_reference_is_the_commands_output(capsys):
    assert cli.main(["config", "--markdown"]) == 0
    generated = capsys.readouterr().out
    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed == generated, f"docs/config.md is out of date; regenerate it: {REGENERATE}"


def test_config_reference_has_one_well_formed_row_per_key(capsys):
    cli.main(["config", "--markdown"])
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    for row in rows:  # a '|' inside a cell is escaped, so every row has exactly four cells
        assert len(re.split(r"(?<!\\)\|", row)) == 6, row
    aliases, *halves = text.split("\n## ")[1:]
    assert aliases.startswith("Coming from TRL / CleanRL / verl / RLinf")
    assert [h.split(" ", 1)[0] for h in halves] == list(cli.HALVES)
    for text, half in zip(halves, cli.HALVES.values()):
        documented = re.findall(r"^\| `([^`]+)` \|", text, flags=re.M)
        assert documented == [k for k in field_help(cli._load(half.config)) if "." in k]


def test_config_without_a_file_or_with_both_is_a_usage_error(capsys):
    assert cli.main(["config"]) == 2
    assert cli.main(["config", "--markdown", "examples/embodied/cartpole_ppo.yaml"]) == 2
    assert "--markdown" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["README.md", "BENCHMARKS.md", "benchmarks/notes/README.md"])
def test_relative_links_point_at_files(name):
    doc = ROOT / name
    for target in re.findall(r"\]\(([^)#:]+)\)", doc.read_text()):
        assert (doc.parent / target).exists(), f"{name}: {target} does not exist"


def readme_commands() -> list[list[str]]:
    """Every `tidal train|sft|eval|config FILE ...` of the README's code blocks, as argv."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words and words[0].endswith("tidal") and words[1] in CONFIG_COMMANDS:
                    commands.append(words[1:])
    return commands


@pytest.mark.parametrize("argv", readme_commands(), ids=" ".join)
def test_readme_commands_name_configs_and_keys_that_resolve(argv):
    _, path, *rest = argv
    overrides = [w for w in rest if "=" in w and not w.startswith("--")]
    assert (ROOT / path).is_file(), path
    args = argparse.Namespace(config=str(ROOT / path), overrides=overrides)
    task, cfg = cli._config(args)
    assert task in cli.HALVES and cfg is not None
