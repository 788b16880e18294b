"""The ``tidal`` command."""

from __future__ import annotations

import argparse
import json
import sys

HALVES = {
    "embodied": ("tidal.config.embodied:EmbodiedConfig", "tidal.runners.embodied:EmbodiedRunner"),
    "llm": ("tidal.config.llm:LLMConfig", "tidal.runners.reasoning:ReasoningRunner"),
}


def _load(spec: str):
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _config(args: argparse.Namespace):
    """The config class of the half ``runner.task`` names (an override wins over the file)."""
    from tidal.config import ConfigError
    from tidal.config.loader import override_value, read_yaml

    task = override_value(args.overrides, "runner.task")
    if task is None:
        task = (read_yaml(args.config).get("runner") or {}).get("task", "embodied")
    if task not in HALVES:
        raise ConfigError(f"runner.task: expected one of {', '.join(HALVES)}, got {task!r}")
    from tidal.config import load_config

    return task, load_config(_load(HALVES[task][0]), args.config, args.overrides)


class _ConfigFailure(Exception):
    """A config error found while building a runner (e.g. an env id that cannot be made)."""


def _fail(kind: str, exc: BaseException) -> int:
    print(f"tidal: {kind}: {exc}", file=sys.stderr, flush=True)
    return 2


def train(args: argparse.Namespace) -> int:
    from tidal.config import ConfigError
    from tidal.runners.loop import Interrupted, run_with_restarts

    _setup_logging()
    try:
        task, cfg = _config(args)
    except (ConfigError, FileNotFoundError) as exc:
        return _fail("config error", exc)

    def make_runner(cfg):
        from tidal.runtime.errors import ClusterUnreachable

        try:
            return _load(HALVES[task][1])(cfg)
        except (ConfigError, FileNotFoundError, ClusterUnreachable) as exc:
            raise _ConfigFailure(exc) from None

    try:
        summary = run_with_restarts(make_runner, cfg)
    except _ConfigFailure as exc:
        return _fail("config error", exc.args[0])
    except Interrupted as exc:
        print(f"tidal: {exc}", file=sys.stderr, flush=True)
        return 128 + exc.signum
    summary.pop("evals", None)  # every evaluation is in metrics.jsonl
    print(json.dumps(summary, indent=2))
    return 0


def config(args: argparse.Namespace) -> int:
    """Print the resolved config with each key's help."""
    from tidal.config import ConfigError, describe

    try:
        _, cfg = _config(args)
    except (ConfigError, FileNotFoundError) as exc:
        return _fail("config error", exc)
    print(describe(cfg))
    return 0


def sft(args: argparse.Namespace) -> int:
    """Supervised warm start of the half ``runner.task`` names: the LM at model.path, or an
    embodied policy by behaviour cloning saved to model.path."""
    from tidal.config import ConfigError

    _setup_logging()
    try:
        task, cfg = _config(args)
        if task == "embodied":
            from tidal.config.embodied import validate_sft
            from tidal.runners.embodied_sft import run_embodied_sft as run
        else:
            from tidal.config.llm import validate_sft
            from tidal.runners.sft import run_sft as run
        validate_sft(cfg)
    except (ConfigError, FileNotFoundError) as exc:
        return _fail("config error", exc)
    print(json.dumps(run(cfg), indent=2))
    return 0


def evaluate(args: argparse.Namespace) -> int:
    """Evaluate a model folder or checkpoint: an LM on the held-out records, an embodied policy
    on fresh episodes; print the summary."""
    from tidal.config import ConfigError

    _setup_logging()
    try:
        task, cfg = _config(args)
        if task == "embodied":
            if args.n is not None:
                raise ConfigError("--n: embodied configs take --episodes and --sampled")
            from tidal.runners.embodied_eval import run_embodied_eval

            summary = run_embodied_eval(cfg, args.checkpoint, args.episodes, args.sampled)
        else:
            if args.episodes is not None or args.sampled:
                raise ConfigError("--episodes, --sampled: LM configs take --n (pass@k)")
            from tidal.runners.evaluate import run_eval

            summary = run_eval(cfg, args.checkpoint, 1 if args.n is None else args.n)
    except (ConfigError, FileNotFoundError) as exc:
        return _fail("config error", exc)
    print(json.dumps(summary, indent=2))
    return 0


def _setup_logging() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")


def serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    from tidal.inference import GenerationEngine, InferenceServer

    engine = GenerationEngine(args.model, max_batch_size=args.max_batch_size)
    server = InferenceServer(
        engine,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        allowed_dirs=args.allow_weights_from or [args.model],
    ).start()
    print(f"tidal: serving {args.model} on {server.address}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tidal", description="RL post-training for agents that act."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="train from a config file")
    p_train.add_argument("config", help="a YAML config, e.g. examples/embodied/cartpole_ppo.yaml")
    p_train.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p_train.set_defaults(fn=train)
    p_config = sub.add_parser("config", help="print the resolved config with each key's help")
    p_config.add_argument("config", help="a YAML config")
    p_config.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p_config.set_defaults(fn=config)
    p_sft = sub.add_parser(
        "sft", help="supervised warm start saved to model.path (LM, or embodied behaviour cloning)"
    )
    p_sft.add_argument("config")
    p_sft.add_argument("overrides", nargs="*")
    p_sft.set_defaults(fn=sft)
    p_eval = sub.add_parser(
        "eval",
        help="score a model or checkpoint: an LM on data.eval_path (the config's reward), "
        "an embodied policy on fresh episodes",
    )
    p_eval.add_argument("config", help="a config, e.g. examples/llm/gsm8k_grpo.yaml")
    p_eval.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p_eval.add_argument(
        "--checkpoint",
        default=None,
        help="a training checkpoint (or checkpoints/ folder) of model.path",
    )
    p_eval.add_argument(
        "--n",
        type=int,
        default=None,
        help="LM: sampled completions per record besides the greedy one (pass@k; default 1)",
    )
    p_eval.add_argument(
        "--episodes",
        type=int,
        default=None,
        help="embodied: episodes, one per env copy (default env.eval_num_envs)",
    )
    p_eval.add_argument(
        "--sampled",
        action="store_true",
        help="embodied: also run the same episodes with sampled actions (eval_sampled/*)",
    )
    p_eval.set_defaults(fn=evaluate)
    p_serve = sub.add_parser(
        "serve", help="serve a Hugging Face causal LM over HTTP (SGLang's API subset)"
    )
    p_serve.add_argument("--model", required=True, help="a local model directory (save_pretrained)")
    p_serve.add_argument("--host", default="127.0.0.1")
    p_serve.add_argument("--port", type=int, default=30000)
    p_serve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint"
    )
    p_serve.add_argument("--max-batch-size", type=int, default=64)
    p_serve.add_argument(
        "--allow-weights-from",
        action="append",
        help="a directory weight updates may load from (repeatable; default: the model's)",
    )
    p_serve.set_defaults(fn=serve)
    from tidal.plot import add_plot_parser

    add_plot_parser(sub)
    args = parser.parse_args(argv)
    from tidal.extras import MissingExtraError

    try:
        return args.fn(args)
    except MissingExtraError as exc:  # a feature of an extra that is not installed
        return _fail("missing extra", exc)


if __name__ == "__main__":
    sys.exit(main())
