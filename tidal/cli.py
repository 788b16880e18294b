"""The ``tidal`` command."""

from __future__ import annotations

import argparse
import json
import sys

import yaml


def _task_of(config_path: str) -> str:
    with open(config_path) as fh:
        data = yaml.safe_load(fh) or {}
    return (data.get("runner") or {}).get("task", "embodied")


def train(args: argparse.Namespace) -> int:
    from tidal.config import ConfigError, EmbodiedConfig, load_config

    try:
        task = _task_of(args.config)
        if task != "embodied":
            raise ConfigError(f"runner.task: expected 'embodied', got {task!r}")
        cfg = load_config(EmbodiedConfig, args.config, args.overrides)
        from tidal.runners import EmbodiedRunner

        runner = EmbodiedRunner(cfg)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"tidal: config error: {exc}", file=sys.stderr)
        return 2
    try:
        summary = runner.run()
    finally:
        runner.close()
    print(json.dumps(summary, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tidal", description="RL post-training for agents that act.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train from a config file")
    p_train.add_argument("config", help="a YAML config, e.g. examples/embodied/cartpole_ppo.yaml")
    p_train.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p_train.set_defaults(fn=train)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
