"""The session proxy: an OpenAI-compatible endpoint per episode that records every call.

``SessionProxy`` serves ``/sessions/{id}/v1/`` ``chat/completions`` (streaming too),
``completions``, ``models`` and a minimal ``responses`` for every open session, each behind its
own bearer token. It sits on the rollout side, in front of the inference servers: a session is
a ``RecordingOpenAI`` (``agent_client``), so a call is rendered by the chat template (tools
included), generated through ``InferenceClient.agenerate`` (resumed across weight updates, the
servers' per-token versions kept) and recorded with its prompt ids, completion ids and
behaviour log-probs, exactly as an in-process agent's calls are. The proxy runs on the event loop
that ``start`` is awaited on (the episodes' loop), so sessions need no locks.

A call with a wrong token is a 401, to an ended session a 409 (calls in flight when it ends are
cancelled and answered 409), to an unknown one a 404; none of them records anything. A streamed
chat completion streams text as the server generates it (``session_stream``); with tools it
arrives whole, one chunk, as tidal's server streams tool calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import socket
import time
import uuid
from dataclasses import dataclass, field

from tidal.extras import needs_extra

with needs_extra("llm", "the session proxy"):
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

from tidal.inference.agent_client import ChatCall, RecordingOpenAI, chat_completion
from tidal.inference.client import InferenceClient, InferenceRefused
from tidal.inference.openai_request import completion_prompts, openai_names
from tidal.inference.openai_response import server_sent_event, usage, whole_stream
from tidal.inference.params import GenerationConfig
from tidal.inference.protocol import ClientGone, error_json, json_body, unless_client_leaves
from tidal.inference.responses_api import chat_arguments, response_object
from tidal.inference.session_stream import chat_stream


@dataclass
class Session:
    id: str
    api_key: str
    base_url: str
    client: RecordingOpenAI
    ended: bool = False
    calls: set = field(default_factory=set)  # requests in flight

    @property
    def completions(self):
        return self.client.completions_made


class SessionRefused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _QuietServer(uvicorn.Server):
    """The run loop handles signals itself: the proxy's server installs no handlers."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class SessionProxy:
    """Recording OpenAI endpoints for episodes, over ``inference`` (one ``RecordingOpenAI`` per
    session, with ``gconfig``'s defaults and ``tool_parser``)."""

    def __init__(
        self,
        inference: InferenceClient,
        tokenizer,
        gconfig: GenerationConfig,
        tool_parser: str = "hermes",
        host: str = "127.0.0.1",
        model_name: str = "tidal",
    ):
        self.inference, self.tokenizer, self.gconfig = inference, tokenizer, gconfig
        self.tool_parser, self.host, self.model_name = tool_parser, host, model_name
        self.sessions: dict[str, Session] = {}
        self._forgotten: dict[str, str] = {}  # ended sessions' keys, their records dropped
        self.refused = 0  # calls answered 401 / 404 / 409
        self.address: str | None = None
        self._server: _QuietServer | None = None
        self._task: asyncio.Task | None = None
        self._closed = False

    async def start(self) -> str:
        """Serve on a free port of ``host`` on the running loop; returns the address."""
        if self.address is not None:
            return self.address
        if self._closed:  # an episode outliving the run would serve on a new port unseen
            raise RuntimeError("SessionProxy.start: the proxy was stopped; it serves no more")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        config = uvicorn.Config(self.app(), log_level="warning", timeout_keep_alive=30)
        self._server = _QuietServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the reason it did not start
            await asyncio.sleep(0.01)
        self.address = f"http://{self.host}:{sock.getsockname()[1]}"
        return self.address

    async def stop(self) -> None:
        self._closed = True
        for sid in list(self.sessions):
            await self.end(sid)
            self.forget(sid)
        if self._server is not None:
            self._server.should_exit = True
            await self._task
            self._server = self._task = self.address = None

    def open(self, gconfig: GenerationConfig | None = None) -> Session:
        """A new session (the proxy must be started), with ``gconfig``'s defaults (else the
        proxy's)."""
        if self.address is None:
            raise RuntimeError("SessionProxy.open: start the proxy first")
        sid = uuid.uuid4().hex
        client = RecordingOpenAI(
            self.inference,
            self.tokenizer,
            self.gconfig if gconfig is None else gconfig,
            session_id=sid,
            tool_parser=self.tool_parser,
        )
        session = Session(
            sid, secrets.token_urlsafe(24), f"{self.address}/sessions/{sid}/v1", client
        )
        self.sessions[sid] = session
        return session

    async def end(self, session_id: str) -> Session:
        """End a session: later calls are refused (409), calls in flight are cancelled; its
        recorded completions stay on the returned ``Session``."""
        session = self.sessions[session_id]
        if not session.ended:
            session.ended = True
            for call in list(session.calls):
                call.cancel()
            await session.client.close()
        return session

    def forget(self, session_id: str) -> None:
        """Drop an ended session's records (its calls are still answered 409)."""
        if self.sessions[session_id].ended:
            self._forgotten[session_id] = self.sessions.pop(session_id).api_key

    # -- HTTP ------------------------------------------------------------------------------

    def _session(self, request: Request, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        key = session.api_key if session is not None else self._forgotten.get(session_id)
        if key is None:
            raise SessionRefused(404, f"no session {session_id!r}")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise SessionRefused(401, "missing or wrong API key for this session")
        if session is None or session.ended:
            raise SessionRefused(409, f"session {session_id} has ended (its episode is over)")
        return session

    async def _call(self, request: Request, session_id: str, answer):
        """Run ``answer(session, body)`` for an authorised session, as a task that ending the
        session cancels."""
        session = self._session(request, session_id)
        body = await json_body(request)
        if not isinstance(body, dict):
            raise ValueError(f"body: must be a JSON object, got {type(body).__name__}")
        task = asyncio.ensure_future(answer(session, body))
        session.calls.add(task)
        try:
            return await unless_client_leaves(request, task)
        except asyncio.CancelledError:
            if task.cancelled() and session.ended:
                raise SessionRefused(409, f"session {session_id} ended during the call") from None
            raise
        finally:  # unless_client_leaves cancelled the task if it is unfinished
            session.calls.discard(task)

    def app(self) -> FastAPI:
        app = FastAPI(title="tidal session proxy")
        prefix = "/sessions/{session_id}/v1"

        @app.exception_handler(SessionRefused)
        async def refused(request: Request, exc: SessionRefused):
            self.refused += 1
            return error_json("/v1/", exc.status, str(exc))  # OpenAI-shaped errors

        @app.exception_handler(ClientGone)
        async def gone(request: Request, exc: ClientGone):
            return error_json("/v1/", 499, str(exc))  # nobody reads it

        @app.exception_handler(InferenceRefused)
        async def server_refused(request: Request, exc: InferenceRefused):
            message = openai_names(exc.detail)  # the agent's request was wrong: say why
            return error_json("/v1/", exc.status, message, param=message.split(":", 1)[0])

        @app.exception_handler(ValueError)
        async def bad_value(request: Request, exc: ValueError):
            message = str(exc)
            return error_json("/v1/", 400, message, param=message.split(":", 1)[0])

        @app.get(prefix + "/models")
        async def models(request: Request, session_id: str):
            self._session(request, session_id)
            model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "tidal"}
            return {"object": "list", "data": [model]}

        @app.post(prefix + "/chat/completions")
        async def chat(request: Request, session_id: str):
            return await self._call(request, session_id, self._chat)

        @app.post(prefix + "/completions")
        async def completions(request: Request, session_id: str):
            return await self._call(request, session_id, self._completion)

        @app.post(prefix + "/responses")
        async def responses(request: Request, session_id: str):
            return await self._call(request, session_id, self._response)

        return app

    async def _chat(self, session: Session, body: dict):
        stream, include_usage = _stream_options(body)
        body.pop("model", None)
        if "messages" not in body:
            raise ValueError("messages: required")
        client = session.client
        call = ChatCall.of(client, **body)
        if stream and call.tools is None:
            return chat_stream(session, call, include_usage, self.model_name)
        record = await client.record(call.prompt, call.cfg, call.messages, call.tools)
        answer = chat_completion(record, client.tokenizer, call.logprobs)
        answer["model"] = self.model_name
        if stream:  # tool calls are known once the answer is whole (as the server streams them)
            return StreamingResponse(
                whole_stream(answer, include_usage), media_type="text/event-stream"
            )
        return JSONResponse(answer)

    async def _completion(self, session: Session, body: dict):
        stream, include_usage = _stream_options(body)
        unknown = set(body) - {"model", "prompt", "max_tokens", "temperature", "top_p", "stop",
                               "seed", "n", "user", "logprobs"}  # fmt: skip
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: not supported by the session proxy")
        if body.get("n", 1) != 1 or body.get("logprobs") is not None:
            raise ValueError("n: the session proxy answers one choice without log-probs")
        prompts = completion_prompts(body.get("prompt"), self.tokenizer)
        if len(prompts) != 1:
            raise ValueError("prompt: the session proxy answers one prompt per call")
        client = session.client
        cfg = client.config(
            body.get("max_tokens", 16), body.get("temperature"), body.get("top_p"),
            body.get("stop"), body.get("seed"),
        )  # fmt: skip
        record = await client.record(prompts[0], cfg)
        head = {"id": record.id.replace("chatcmpl", "cmpl"), "created": int(time.time())}
        head.update(model=self.model_name, object="text_completion")
        choice = {"index": 0, "text": record.text, "finish_reason": record.finish_reason}
        counts = usage(len(record.prompt_ids), len(record.output_ids))
        if not stream:
            return {**head, "choices": [{**choice, "logprobs": None}], "usage": counts}

        def events():
            yield server_sent_event({**head, "choices": [{**choice, "logprobs": None}]})
            if include_usage:
                yield server_sent_event({**head, "choices": [], "usage": counts})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _response(self, session: Session, body: dict):
        arguments = chat_arguments(body)
        out = await session.client.chat.completions.create(**arguments)
        return response_object(out, self.model_name)


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = body.pop("stream", False) or False
    options = body.pop("stream_options", None) or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise ValueError("stream: must be true or false (stream_options an object)")
    return stream, bool(options.get("include_usage"))
