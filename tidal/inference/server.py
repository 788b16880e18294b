"""An HTTP server for the engine, speaking the subset of SGLang's API that RL needs.

Endpoints (SGLang's names and fields): ``POST /generate`` (``stream: true``: server-sent events
of the new token ids, the last one the whole result), ``POST /pause_generation``,
``POST /continue_generation``, ``POST /update_weights_from_disk``,
``POST /update_weights_from_tensors`` (a safetensors body, for trainers in the same cluster),
``GET /health``, ``GET /get_model_info``, ``POST /flush_cache``; and OpenAI's ``/v1/models``,
``/v1/completions`` and ``/v1/chat/completions`` (see ``openai_api``). Binds 127.0.0.1 by default;
with an API key every endpoint needs ``Authorization: Bearer <key>``. Weights load only from
directories the operator allowed, and only as safetensors.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import threading
from pathlib import Path
from typing import Literal

from safetensors.torch import load, load_file

from tidal.extras import needs_extra

with needs_extra("llm", "the inference server"):
    import uvicorn
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.exceptions import RequestValidationError
    from pydantic import BaseModel, ConfigDict
    from starlette.exceptions import HTTPException as StarletteHTTPException

from tidal.inference.engine import EngineDied, EngineError, GenerationEngine
from tidal.inference.http_guard import ConnectionGuard
from tidal.inference.openai_api import add_openai_routes
from tidal.inference.protocol import (
    ClientGone,
    error_json,
    generate_all,
    json_body,
    parse_generate,
    result_json,
    stream_generate,
    unless_client_leaves,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PauseBody(_Strict):
    mode: Literal["abort", "in_place"] = "abort"


class UpdateFromDiskBody(_Strict):
    model_path: str
    weight_version: int | None = None


def build_app(
    engine: GenerationEngine,
    api_key: str | None = None,
    allowed_dirs: list[str] | None = None,
    served_model_name: str | None = None,
    tool_parser: str = "hermes",
) -> FastAPI:
    app = FastAPI(title="tidal inference server")
    allowed = [Path(d).resolve() for d in (allowed_dirs or [])]

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_json(request.url.path, 401, "missing or wrong API key")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        problems = [
            f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors()
        ]
        return error_json(request.url.path, 400, "; ".join(problems))

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, exc: ValueError):
        # every check of a request raises ValueError naming the field: a 400, never a 500
        message = str(exc)
        return error_json(request.url.path, 400, message, param=message.split(":", 1)[0])

    @app.exception_handler(EngineError)
    async def conflict(request: Request, exc: EngineError):
        return error_json(request.url.path, 409, str(exc))

    @app.exception_handler(EngineDied)
    async def died(request: Request, exc: EngineDied):
        return error_json(request.url.path, 500, str(exc))

    @app.exception_handler(ClientGone)
    async def gone(request: Request, exc: ClientGone):
        return error_json(request.url.path, 499, str(exc))  # nginx's "client closed request"

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error_json(request.url.path, exc.status_code, str(exc.detail))

    @app.post("/generate")
    async def generate(request: Request):
        """SGLang's ``/generate``: one result, or a list (``n > 1`` or a batch of prompts)."""
        call = parse_generate(await json_body(request), engine.tokenizer)
        if call.stream:
            return stream_generate(engine, call)
        jobs = call.expanded()
        work = generate_all(engine, [(prompt, cfg, rid) for _, prompt, cfg, rid in jobs])
        results = await unless_client_leaves(request, work)
        out = [
            result_json(
                r,
                engine.tokenizer,
                call.return_logprob,
                call.text_options[p],
                call.return_text_in_logprobs,
            )
            for (p, *_), r in zip(jobs, results)
        ]
        return out if call.batched or call.n > 1 else out[0]

    @app.post("/pause_generation")
    async def pause(body: PauseBody | None = None):
        await asyncio.to_thread(engine.pause, (body or PauseBody()).mode)
        return {"success": True, "weight_version": engine.weight_version}

    @app.post("/continue_generation")
    async def resume():
        engine.resume()
        return {"success": True}

    def _load_allowed(path: str) -> dict:
        folder = Path(path).resolve()
        if not any(folder == a or a in folder.parents for a in allowed):
            raise HTTPException(
                status_code=403, detail=f"model_path {path!r} is not under an allowed directory"
            )
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise HTTPException(
                status_code=400, detail=f"model_path {path!r} holds no .safetensors file"
            )
        state = {}
        for f in files:
            state.update(load_file(str(f)))
        return state

    def _update(state: dict, version: int | None) -> dict:
        # EngineError (not paused) is a 409, WeightsRejected (a ValueError) a 400
        engine.update_weights(state, engine.weight_version + 1 if version is None else version)
        return {"success": True, "weight_version": engine.weight_version}

    @app.post("/update_weights_from_disk")
    async def update_from_disk(body: UpdateFromDiskBody):
        state = await asyncio.to_thread(_load_allowed, body.model_path)
        return await asyncio.to_thread(_update, state, body.weight_version)

    @app.post("/update_weights_from_tensors")
    async def update_from_tensors(request: Request, weight_version: int | None = None):
        try:
            state = load(await request.body())
        except Exception as exc:  # a malformed body is the client's fault
            raise HTTPException(
                status_code=400, detail=f"body is not a safetensors blob: {exc}"
            ) from None
        return await asyncio.to_thread(_update, state, weight_version)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/get_model_info")
    async def model_info():
        return {
            "model_path": engine.model_dir,
            "vocab_size": engine.vocab_size,
            "weight_version": engine.weight_version,
            "max_position_embeddings": engine.max_positions,
            "is_generation": True,
            "paused": engine.paused,
        }

    @app.post("/flush_cache")
    async def flush_cache():
        return {"success": True, "message": "no prefix cache is kept; nothing to flush"}

    add_openai_routes(app, engine, served_model_name or Path(engine.model_dir).name, tool_parser)
    return app


class InferenceServer:
    """The engine behind uvicorn in a background thread of this process."""

    def __init__(
        self,
        engine: GenerationEngine,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        allowed_dirs: list[str] | None = None,
        served_model_name: str | None = None,
        header_timeout_s: float = 10.0,
        body_timeout_s: float = 120.0,
        max_connections: int | None = None,
        tool_parser: str = "hermes",
    ):
        self.engine = engine
        # bounded request read times and connections: idle or half-sent connections cannot
        # starve the server of descriptors (see http_guard)
        self.guard = ConnectionGuard(header_timeout_s, body_timeout_s, max_connections)
        self.socket = self.guard.listener()
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.host, self.port = host, self.socket.getsockname()[1]
        app = build_app(engine, api_key, allowed_dirs, served_model_name, tool_parser)
        self._server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level="warning",
                timeout_keep_alive=30,
                http=self.guard.protocol(),
                backlog=4096,
            )
        )
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self.socket]},
            name=f"tidal-server-{self.port}",
            daemon=True,
        )

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> InferenceServer:
        self._thread.start()
        import time

        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(
                    f"the inference server on {self.address} did not start within {timeout:g} s"
                )
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.socket.close()
        self.engine.close()
