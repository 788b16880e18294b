"""An HTTP server for the engine, speaking the subset of SGLang's API that RL needs.

Endpoints (SGLang's names and fields): ``POST /generate``, ``POST /pause_generation``,
``POST /continue_generation``, ``POST /update_weights_from_disk``,
``POST /update_weights_from_tensors`` (a safetensors body, for trainers in the same cluster),
``GET /health``, ``GET /get_model_info``, ``POST /flush_cache``. Binds 127.0.0.1 by default;
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

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load, load_file

from tidal.inference.engine import EngineError, GenerationEngine, GenerationResult, SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParamsBody(_Strict):
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None
    n: int = Field(1, ge=1, le=256)  # samples of this prompt (sample i is seeded seed + i)


class GenerateBody(_Strict):
    input_ids: list[int]
    sampling_params: SamplingParamsBody = Field(default_factory=SamplingParamsBody)
    return_logprob: bool = False
    rid: str | None = None


class PauseBody(_Strict):
    mode: Literal["abort", "in_place"] = "abort"


class UpdateFromDiskBody(_Strict):
    model_path: str
    weight_version: int | None = None


def _finish_reason(result: GenerationResult) -> dict:
    if result.finish_reason == "stop":
        return {"type": "stop", "matched": result.matched_stop}
    if result.finish_reason == "length":
        return {"type": "length", "length": len(result.output_ids)}
    return {"type": "abort", "message": "generation was paused"}


def _result_json(result: GenerationResult, return_logprob: bool) -> dict:
    meta = {"id": result.rid, "finish_reason": _finish_reason(result), "weight_version": result.weight_version,
            "prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.output_ids),
            "output_token_versions": result.output_versions}
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(result.output_logprobs, result.output_ids)]
    return {"output_ids": result.output_ids, "meta_info": meta}


def build_app(engine: GenerationEngine, api_key: str | None = None, allowed_dirs: list[str] | None = None) -> FastAPI:
    app = FastAPI(title="tidal inference server")
    allowed = [Path(d).resolve() for d in (allowed_dirs or [])]

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return JSONResponse({"error": "missing or wrong API key"}, status_code=401)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_request, exc: RequestValidationError):
        problems = [f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors()]
        return JSONResponse({"error": "; ".join(problems)}, status_code=400)

    @app.post("/generate")
    async def generate(body: GenerateBody):
        """One result, or a list of ``n`` results (SGLang's shape) when ``sampling_params.n > 1``."""
        p = body.sampling_params
        loop = asyncio.get_running_loop()
        waiting = []
        try:
            for i in range(p.n):
                params = SamplingParams(max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
                                        top_k=p.top_k, stop_token_ids=p.stop_token_ids,
                                        seed=None if p.seed is None else p.seed + i)
                done: asyncio.Future[GenerationResult] = loop.create_future()
                rid = body.rid if p.n == 1 or body.rid is None else f"{body.rid}-{i}"
                engine.submit(body.input_ids, params, lambda r, f=done: loop.call_soon_threadsafe(_settle, f, r), rid=rid)
                waiting.append(done)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None
        results = [_result_json(await done, body.return_logprob) for done in waiting]
        return results[0] if p.n == 1 else results

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
            raise HTTPException(status_code=403, detail=f"model_path {path!r} is not under an allowed directory")
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise HTTPException(status_code=400, detail=f"model_path {path!r} holds no .safetensors file")
        state = {}
        for f in files:
            state.update(load_file(str(f)))
        return state

    def _update(state: dict, version: int | None) -> dict:
        try:
            engine.update_weights(state, engine.weight_version + 1 if version is None else version)
        except EngineError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from None
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
            raise HTTPException(status_code=400, detail=f"body is not a safetensors blob: {exc}") from None
        return await asyncio.to_thread(_update, state, weight_version)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/get_model_info")
    async def model_info():
        return {"model_path": engine.model_dir, "vocab_size": engine.vocab_size, "weight_version": engine.weight_version,
                "max_position_embeddings": engine.max_positions, "is_generation": True, "paused": engine.paused}

    @app.post("/flush_cache")
    async def flush_cache():
        return {"success": True, "message": "no prefix cache is kept; nothing to flush"}

    return app


def _settle(fut: asyncio.Future, result: GenerationResult) -> None:
    if not fut.done():
        fut.set_result(result)


class InferenceServer:
    """The engine behind uvicorn in a background thread of this process."""

    def __init__(self, engine: GenerationEngine, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 allowed_dirs: list[str] | None = None):
        self.engine = engine
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.host, self.port = host, self.socket.getsockname()[1]
        app = build_app(engine, api_key, allowed_dirs)
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_keep_alive=30))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.socket]},
                                        name=f"tidal-server-{self.port}", daemon=True)

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> InferenceServer:
        self._thread.start()
        import time

        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the inference server on {self.address} did not start within {timeout:g} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.socket.close()
        self.engine.close()
