"""The test suite's own rules: modules by subject and of a readable size, no test twice, Ray
modules declared for the scheduler, and optional dependencies that fail CI when missing."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from conftest import RAY_MODULES
from deps import require

TESTS = Path(__file__).parent
MAX_LINES = 600


def test_modules_stay_readable():
    long = {
        p.name: n for p in TESTS.glob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines, split by subject: {long}"


# one name, two subjects (each module says which): not a test written twice
SAME_NAME_APART = {
    "test_a_training_step_does_not_depend_on_the_micro_batch_size": "MLP policy / flow policy",
}


def test_no_test_is_written_twice():
    seen: dict[str, str] = {}
    twice = []
    for path in sorted(TESTS.glob("test_*.py")):
        for name in re.findall(r"^def (test_\w+)", path.read_text(), flags=re.M):
            if name in seen and name not in SAME_NAME_APART:
                twice.append(f"{name}: {seen[name]} and {path.name}")
            seen[name] = path.name
    assert not twice, twice


def test_ray_modules_exist():
    assert {p.stem for p in TESTS.glob("test_*.py")} >= RAY_MODULES


def test_a_missing_dependency_fails_under_ci_and_skips_elsewhere(monkeypatch):
    missing = "tidal_no_such_module"
    monkeypatch.setenv("CI", "true")
    with pytest.raises(ImportError, match=missing):
        require(missing)
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match="CI fails on this"):
        require(missing)
    assert require("json") is sys.modules["json"]
