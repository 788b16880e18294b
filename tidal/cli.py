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
    from tidal.config.llm import LLMConfig

    try:
        task = _task_of(args.config)
        if task == "embodied":
            from tidal.runners import EmbodiedRunner

            runner = EmbodiedRunner(load_config(EmbodiedConfig, args.config, args.overrides))
        elif task == "llm":
            from tidal.runners.reasoning import ReasoningRunner

            runner = ReasoningRunner(load_config(LLMConfig, args.config, args.overrides))
        else:
            raise ConfigError(f"runner.task: expected 'embodied' or 'llm', got {task!r}")
    except (ConfigError, FileNotFoundError) as exc:
        print(f"tidal: config error: {exc}", file=sys.stderr)
        return 2
    try:
        summary = runner.run()
    finally:
        runner.close()
    print(json.dumps(summary, indent=2))
    return 0


def sft(args: argparse.Namespace) -> int:
    import logging

    from tidal.config import ConfigError, load_config
    from tidal.config.llm import LLMConfig
    from tidal.runners.sft import run_sft

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cfg = load_config(LLMConfig, args.config, args.overrides)
    except ConfigError as exc:
        print(f"tidal: config error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(run_sft(cfg), indent=2))
    return 0


def serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    from tidal.inference import GenerationEngine, InferenceServer

    engine = GenerationEngine(args.model, max_batch_size=args.max_batch_size)
    server = InferenceServer(engine, host=args.host, port=args.port, api_key=args.api_key,
                             allowed_dirs=args.allow_weights_from or [args.model]).start()
    print(f"tidal: serving {args.model} on {server.address}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tidal", description="RL post-training for agents that act.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train from a config file")
    p_train.add_argument("config", help="a YAML config, e.g. examples/embodied/cartpole_ppo.yaml")
    p_train.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p_train.set_defaults(fn=train)
    p_sft = sub.add_parser("sft", help="supervised warm start of the LM named by model.path")
    p_sft.add_argument("config")
    p_sft.add_argument("overrides", nargs="*")
    p_sft.set_defaults(fn=sft)
    p_serve = sub.add_parser("serve", help="serve a Hugging Face causal LM over HTTP (SGLang's API subset)")
    p_serve.add_argument("--model", required=True, help="a local model directory (save_pretrained)")
    p_serve.add_argument("--host", default="127.0.0.1")
    p_serve.add_argument("--port", type=int, default=30000)
    p_serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint")
    p_serve.add_argument("--max-batch-size", type=int, default=64)
    p_serve.add_argument("--allow-weights-from", action="append",
                         help="a directory weight updates may load from (repeatable; default: the model's)")
    p_serve.set_defaults(fn=serve)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
