"""The documents a user reads: sizes, the generated config reference, links, and every command\nthey show, run (tests/doc_commands.py says how)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from doc_commands import (
    COMMANDS,
    command_params,
    documented_commands,
    key,
    run_documented,
    workspace,  # noqa: F401 (a fixture)
)

from tidal import cli
from tidal.config import field_help

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = "tidal config --markdown > docs/config.md"


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


def test_every_documented_command_has_a_way_to_run():
    """Each command of README.md and docs/*.md is run below (or in test_docs_ray.py), or
    checked by `tidal config`, or (a make target) says what runs it."""
    documented = documented_commands()
    missing = [f"{doc}: {key(argv)}" for doc, argv in documented if key(argv) not in COMMANDS]
    assert not missing, f"add these to tests/doc_commands.py's COMMANDS: {missing}"
    stale = set(COMMANDS) - {key(argv) for _, argv in documented}
    assert not stale, f"in tests/doc_commands.py, no longer documented: {sorted(stale)}"
    make = (ROOT / "Makefile").read_text()
    for _, argv in documented:
        way = COMMANDS[key(argv)]
        if argv[0] == "make":
            assert way.not_run and re.search(rf"^{argv[1]}:", make, flags=re.M), argv
    recipe = re.search(r"^train:.*\n\t(.*)$", make, flags=re.M).group(1)
    assert recipe.endswith("tidal train examples/embodied/cartpole_ppo.yaml"), recipe


@pytest.mark.parametrize(("doc", "argv", "way"), command_params(ray=False))
def test_a_documented_command_runs(workspace, doc, argv, way, capsys):  # noqa: F811
    """The documents' commands in their order (an sft before the train that starts from its
    model, two CartPole runs before the plot that draws both), each shortened."""
    run_documented(workspace, doc, argv, way, capsys)
