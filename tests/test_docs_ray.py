"""The documents' commands that start Ray clusters (tests/doc_commands.py), run shortened in
their order in one Ray session (tests/conftest.py: ray_session)."""

import pytest
from doc_commands import command_params, run_documented, workspace  # noqa: F401 (a fixture)


@pytest.mark.ray
@pytest.mark.parametrize(("doc", "argv", "way"), command_params(ray=True))
def test_a_documented_ray_command_runs(workspace, ray_session, doc, argv, way, capsys):  # noqa: F811
    """In the workspace before the Ray session starts: Ray's workers start in the driver's
    working directory, where a user runs tidal (relative paths such as model.path resolve
    there)."""
    run_documented(workspace, doc, argv, way, capsys)
