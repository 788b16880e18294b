"""vLLM as a rollout engine: launch and supervise vLLM's OpenAI-compatible server, and speak
its RL endpoints from ``InferenceClient``.

vLLM runs in its own virtualenv (it pins an older transformers than tidal): by default
``<repo>/.venv-vllm/bin/python`` or ``$TIDAL_VLLM_PYTHON``. The server is started with its
development endpoints (``VLLM_SERVER_DEV_MODE=1``: ``/pause``, ``/resume``,
``/collective_rpc``, ``/update_weight_version``), the token-in/token-out endpoint
``/inference/v1/generate`` (``--enable-scale-out``), which reports the weight version of every
span of tokens, and ``--logprobs-mode processed_logprobs`` so that log-probs are those of the
distribution actually sampled from (after temperature), as with tidal's engine.

    server = VLLMServer(model_dir).start()
    client = InferenceClient([server.address], protocol=VLLMProtocol())
    await client.agenerate(ModelRequest(ids, GenerationConfig(...)))   # tokens, log-probs, versions
    await client.update_weights(version=1, model_path=folder)          # pause → reload → resume

Known limit of vLLM 0.32's CPU worker: a seeded request (``GenerationConfig.seed``, or an agent's
``seed``) whose prefill is chunked kills the server (``CPU Generator does not use offset``), as
when many aborted requests are resubmitted at once; tidal's own rollouts send no seed.
``rollout.vllm_args=[--no-enable-chunked-prefill]`` avoids it (measured: 128 seeded sequences
aborted mid-generation and resubmitted, no crash).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tidal.extras import needs_extra
from tidal.runtime.errors import WeightSyncError
from tidal.runtime.tether import tethered

with needs_extra("llm", "the vLLM engine"):
    import httpx

from tidal.inference.client import ModelRequest, ModelResponse
from tidal.models.gguf import model_folder

REPO = Path(__file__).resolve().parents[2]
# httpx logs every request at INFO: three lines per server at each weight update in train.log
logging.getLogger("httpx").setLevel(logging.WARNING)
# rollout.pause_mode → vLLM's: in_place is SGLang's (and tidal's engine's) name for keep
PAUSE_MODES = {"abort": "abort", "keep": "keep", "in_place": "keep"}


class ServerDied(ConnectionError):
    """A supervised vLLM server process is gone (a worker fault: runner.max_restarts applies)."""


def default_vllm_python() -> str:
    """Where vLLM's interpreter is looked for: ``$TIDAL_VLLM_PYTHON``, else the repo's
    ``.venv-vllm`` (``make vllm``)."""
    return os.environ.get("TIDAL_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")


def vllm_python() -> str | None:
    """The interpreter of vLLM's virtualenv, or ``None`` when there is none."""
    candidate = default_vllm_python()
    return candidate if Path(candidate).exists() else None


class VLLMProtocol:
    """``InferenceClient``'s requests in vLLM's dialect. vLLM labels weights with strings;
    tidal's integer versions are sent and read back as such (``initial_version`` until the
    first update)."""

    name = "vllm"
    supports_tensors = False

    def __init__(self, initial_version: int = 0):
        self.initial_version = initial_version

    # the driver's or a rank's synchronous calls of the weight-update cycle (one server each)

    def generate(self, req: ModelRequest, out: ModelResponse, n: int) -> tuple[str, dict]:
        g = req.gconfig.seeded(out.output_len)
        n = 1 if g.greedy else n  # vLLM refuses n > 1 when greedy; the samples are equal anyway
        params = {
            "max_tokens": g.max_new_tokens - out.output_len,
            "n": n,
            "logprobs": 0,
            "temperature": 0.0 if g.greedy else g.temperature,  # vLLM's greedy bound is 1e-5
            "top_p": g.top_p,
            "top_k": g.top_k if g.top_k > 0 else -1,
            "seed": g.seed,
            "stop_token_ids": g.stop_token_ids,
            "ignore_eos": True,
        }  # stop only at the ids asked for
        if g.stop:
            params["stop"] = g.stop
        return "/inference/v1/generate", {
            "token_ids": req.input_ids + out.output_tokens,
            "sampling_params": params,
            "request_id": f"{req.rid}-{out.output_len}",
        }

    def samples(self, result: dict, n: int) -> list[dict]:
        choices = sorted(result["choices"], key=lambda c: c["index"])
        return [dict(choices[0]) for _ in range(n)] if len(choices) == 1 else choices

    def absorb(self, out: ModelResponse, choice: dict) -> str:
        tokens = choice.get("token_ids") or []
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(tokens):
            raise ValueError(f"vLLM answered {len(tokens)} tokens with {len(content)} log-probs")
        out.output_tokens += tokens
        out.output_logprobs += [c["logprob"] for c in content]
        out.output_versions += self._versions(choice.get("weight_versions"), len(tokens))
        reason = choice.get("finish_reason")
        return {"abort": "abort", "length": "length", "stop": "stop"}.get(
            reason, "stop" if reason else "abort"
        )

    def _versions(self, spans: list[dict] | None, count: int) -> list[int]:
        versions = [self.initial_version] * count
        for span in spans or []:
            label = span.get("version")
            version = (
                int(label)
                if label is not None and str(label).lstrip("-").isdigit()
                else self.initial_version
            )
            for i in range(span["start"], min(span["end"], count)):
                versions[i] = version
        return versions

    def pause(self, mode: str) -> tuple[str, dict | None, dict | None]:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode: expected one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        return "/pause", None, {"mode": PAUSE_MODES[mode]}

    def resume(self) -> tuple[str, dict]:
        return "/resume", {}

    def update_from_disk(self, model_path: str, version: int) -> list[tuple[str, dict]]:
        """Reload a ``save_pretrained`` safetensors folder, then label the weights."""
        return [
            (
                "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": str(model_path)}},
            ),
            ("/update_weight_version", {"new_version": str(version)}),
        ]


def control(address: str, endpoint: str, payload=None, params=None, timeout: float = 120.0):
    """One synchronous call of vLLM's development endpoints (pause, resume, reload), bounded by
    ``timeout``; an error answer raises naming the server and endpoint."""
    resp = httpx.post(address + endpoint, json=payload, params=params, timeout=timeout)
    if resp.status_code >= 400:
        raise RuntimeError(f"vLLM {address}{endpoint} answered {resp.status_code}: {resp.text}")
    return resp


def pause(address: str, mode: str, timeout: float = 120.0) -> None:
    endpoint, payload, params = VLLMProtocol().pause(mode)
    control(address, endpoint, payload, params, timeout)


def resume(address: str, timeout: float = 120.0) -> None:
    control(address, *VLLMProtocol().resume(), timeout=timeout)


def reload_weights(address: str, folder: str, version: int, timeout: float = 600.0) -> None:
    """Reload a ``save_pretrained`` folder (while paused) and label the weights ``version``.
    A server that stops answering mid-reload is a broken weight link (a restart cures it)."""
    for endpoint, payload in VLLMProtocol().update_from_disk(folder, version):
        try:
            control(address, endpoint, payload, timeout=timeout)
        except httpx.TransportError as exc:
            raise WeightSyncError(
                f"vLLM {address}{endpoint}: reload of {folder} (version {version}) failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc


def _kill_session(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class VLLMServer:
    """One vLLM server process for a model folder, supervised: ``start`` waits for ``/health``
    within a timeout (naming the log file when it fails or the process exits), ``stop`` ends
    it (SIGTERM, then SIGKILL)."""

    def __init__(
        self,
        model_dir: str | Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        max_model_len: int | None = None,
        served_model_name: str = "tidal",
        python: str | None = None,
        kv_cache_gib: int = 1,
        extra_args: list[str] | None = None,
        log_dir: str | None = None,
    ):
        self.python = python or vllm_python()
        if self.python is None:
            raise FileNotFoundError(
                "vLLM's virtualenv was not found: build it with `make vllm` "
                "or set TIDAL_VLLM_PYTHON to its python"
            )
        self.model_dir, self.host = model_folder(model_dir), host  # a GGUF file: its folder
        self.port = port or _free_port(host)
        self.served_model_name = served_model_name
        args = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model_dir,
            "--host",
            host,
            "--port",
            str(self.port),
            "--served-model-name",
            served_model_name,
            "--dtype",
            "float32",
            "--enforce-eager",
            "--enable-scale-out",
            "--logprobs-mode",
            "processed_logprobs",
            "--gpu-memory-utilization",
            "0.1",
        ]
        if max_model_len:
            args += ["--max-model-len", str(max_model_len)]
        self.args = args + list(extra_args or [])
        self.env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)),
        }
        self.log_path = (
            Path(log_dir or tempfile.mkdtemp(prefix="tidal-vllm-")) / f"vllm-{self.port}.log"
        )
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 300.0) -> VLLMServer:
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                tethered(self.args),  # dies with this process, even SIGKILLed
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with code {self.process.returncode} while starting; "
                    f"see {self.log_path}:\n{self._tail()}"
                )
            try:
                if httpx.get(self.address + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(
            f"vLLM did not answer /health within {timeout:g} s; see {self.log_path}:\n{self._tail()}"
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def check_alive(self) -> None:
        """Raise ``ServerDied`` (with the log's tail) when the process has exited."""
        if not self.alive():
            code = None if self.process is None else self.process.returncode
            raise ServerDied(
                f"the vLLM server at {self.address} exited with code {code}; "
                f"see {self.log_path}:\n{self._tail()}"
            )

    def _tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the server's session (its engine-core child goes too), then SIGKILL; a
        server that already died may have left that child: it is killed as well."""
        if self.process is None:
            return
        if self.process.poll() is not None:
            _kill_session(self.process.pid, signal.SIGKILL)
            return
        _kill_session(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill_session(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
