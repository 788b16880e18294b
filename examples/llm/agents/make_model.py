"""Write the tiny tool-calling model the example trains: a Qwen2 with a Hermes/Qwen tool chat
template, overfit in seconds on one calculator conversation (tests/agent_models.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from agent_models import save_tool_model  # noqa: E402

if __name__ == "__main__":
    print(save_tool_model(sys.argv[1] if len(sys.argv) > 1 else "runs/models/tool-agent"))
