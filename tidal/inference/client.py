"""The client the trainer and workflows use: resumable ``agenerate`` over one or many servers
(tidal's own or SGLang, which speak the same HTTP subset)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from safetensors.torch import save

from tidal.extras import needs_extra

with needs_extra("llm", "the inference client"):
    import aiohttp

from tidal.inference.params import GenerationConfig, with_episode_seed

StopReason = Literal["stop", "length", "abort"]


@dataclass
class ModelRequest:
    input_ids: list[int]
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    # requests of one session (e.g. the turns of an episode) go to one server, where a prefix
    # cache can reuse their shared context; without one, a request goes to the least loaded
    session_id: str | None = None


def _episode_seeded(req: ModelRequest) -> ModelRequest:
    """Inside an episode with seeds, an unseeded sampling request takes the next one."""
    gconfig = with_episode_seed(req.gconfig)
    return req if gconfig is req.gconfig else replace(req, gconfig=gconfig)


@dataclass
class ModelResponse:
    input_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(
        default_factory=list
    )  # the server-stamped version of every token
    stop_reason: StopReason = "stop"

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)


class InferenceError(RuntimeError):
    pass


class InferenceRefused(InferenceError):
    """A server answered 4xx: the request is wrong (retrying cannot help); ``detail`` is the
    server's own message."""

    def __init__(self, message: str, status: int, detail: str):
        super().__init__(message)
        self.status, self.detail = status, detail


def _error_message(text: str) -> str:
    """The message of a server's error body (tidal's ``{"error": m}``, OpenAI's
    ``{"error": {"message": m}}``), else the body."""
    try:
        error = json.loads(text).get("error", text)
    except (json.JSONDecodeError, AttributeError):
        return text
    return str(error.get("message", error) if isinstance(error, dict) else error)


class SGLangProtocol:
    """The requests of tidal's servers and SGLang's: ``/generate`` with token ids, and the
    pause → update → continue endpoints."""

    name = "sglang"

    def generate(self, req: ModelRequest, out: ModelResponse, n: int) -> tuple[str, dict]:
        """The prompt plus the tokens so far, the rest of the budget."""
        g = req.gconfig.seeded(out.output_len)
        params = {
            "max_new_tokens": g.max_new_tokens - out.output_len,
            "temperature": g.temperature,
            "top_p": g.top_p,
            "top_k": g.top_k,
            "stop_token_ids": g.stop_token_ids,
            "seed": g.seed,
            "n": n,
            "ignore_eos": True,
        }  # stop only at the ids asked for (SGLang stops at EOS)
        if g.stop:
            params["stop"] = g.stop
        payload = {
            "input_ids": req.input_ids + out.output_tokens,
            "sampling_params": params,
            "return_logprob": True,
            "rid": req.rid,
        }
        if g.top_logprobs:
            payload["top_logprobs_num"] = g.top_logprobs
        return "/generate", payload

    # tidal's server streams /generate: events of new token ids, the last the whole result
    supports_stream = True

    def samples(self, result, n: int) -> list[dict]:
        return [result] if n == 1 else result

    def absorb(self, out: ModelResponse, result: dict) -> str:
        meta, tokens = result["meta_info"], result["output_ids"]
        out.output_tokens += tokens
        out.output_logprobs += [lp for lp, _, _ in meta["output_token_logprobs"]]
        out.output_versions += meta.get("output_token_versions") or [meta["weight_version"]] * len(
            tokens
        )
        return meta["finish_reason"]["type"]

    def pause(self, mode: str) -> tuple[str, dict | None, dict | None]:
        return "/pause_generation", {"mode": mode}, None

    def resume(self) -> tuple[str, dict]:
        return "/continue_generation", {}

    def update_from_disk(self, model_path: str, version: int) -> list[tuple[str, dict]]:
        return [
            ("/update_weights_from_disk", {"model_path": model_path, "weight_version": version})
        ]

    supports_tensors = True


class InferenceClient:
    """Requests of one ``session_id`` stick to one server; the others go to the least loaded
    (fewest requests in flight from this client)."""

    def __init__(
        self,
        addresses: list[str],
        api_key: str | None = None,
        timeout: float = 300.0,
        max_retries: int = 4,
        backoff_s: float = 0.2,
        resume_delay_s: float = 0.05,
        protocol: SGLangProtocol | None = None,
    ):
        if not addresses:
            raise ValueError("InferenceClient: needs at least one server address")
        self.addresses = [a.rstrip("/") for a in addresses]
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout, self.max_retries, self.backoff_s = timeout, max_retries, backoff_s
        self.resume_delay_s = resume_delay_s
        self._in_flight = {a: 0 for a in self.addresses}
        self.protocol = protocol or SGLangProtocol()  # tidal.inference.vllm.VLLMProtocol for vLLM
        self._http: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # aiohttp rather than httpx: httpx's pool costs O(open connections) per request, which
        # dominated generation with hundreds of concurrent episodes
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                connector=aiohttp.TCPConnector(limit=1024, limit_per_host=1024),
            )
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    def pick_server(self, session_id: str | None = None) -> str:
        if session_id is not None:
            digest = int(hashlib.sha1(session_id.encode()).hexdigest(), 16)
            return self.addresses[digest % len(self.addresses)]
        return min(self.addresses, key=lambda a: self._in_flight[a])

    async def request(
        self,
        address: str,
        endpoint: str,
        payload: dict | None = None,
        method: str = "POST",
        content: bytes | None = None,
        params: dict | None = None,
    ) -> dict:
        """One call with retries on connection errors and 5xx answers (exponential backoff);
        a 4xx answer raises at once with the server's message."""
        last = None
        for attempt in range(self.max_retries + 1):
            try:
                async with self._client().request(
                    method, address + endpoint, json=payload, data=content, params=params
                ) as resp:
                    text = await resp.text()
                    if resp.status < 400:
                        return json.loads(text)
                    if resp.status < 500:
                        raise InferenceRefused(
                            f"server {address}{endpoint} refused the request ({resp.status}): {text}",
                            resp.status,
                            _error_message(text),
                        )
                    last = f"HTTP {resp.status}: {text[:200]}"
            except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if attempt < self.max_retries:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise InferenceError(
            f"server {address}{endpoint} failed after {self.max_retries + 1} attempts: {last}"
        )

    async def agenerate(
        self, req: ModelRequest, on_tokens: Callable[[list[int]], None] | None = None
    ) -> ModelResponse:
        """Generate, resuming after every abort (a weight update) with the prompt plus the tokens
        so far and the remaining budget, until the request stops or its budget is spent.
        ``on_tokens(ids)`` is called with the new tokens as the server streams them (once per
        answer where the protocol does not stream)."""
        req = _episode_seeded(req)
        address = self.pick_server(req.session_id)
        if on_tokens is None or not getattr(self.protocol, "supports_stream", False):
            out = (await self.agenerate_n(req, 1))[0]
            if on_tokens is not None:
                on_tokens(out.output_tokens)
            return out
        self._in_flight[address] += 1
        try:
            out, reason = ModelResponse(input_tokens=list(req.input_ids)), None
            while reason not in ("stop", "length") and out.output_len < req.gconfig.max_new_tokens:
                if reason is not None:  # aborted by a weight update: resume
                    await asyncio.sleep(self.resume_delay_s)
                endpoint, payload = self.protocol.generate(req, out, 1)
                result = await self._stream(
                    address, endpoint, {**payload, "stream": True}, on_tokens
                )
                reason = self.protocol.absorb(out, result)
            out.stop_reason = "length" if reason in (None, "abort") else reason
            return out
        finally:
            self._in_flight[address] -= 1

    async def _stream(self, address: str, endpoint: str, payload: dict, on_tokens) -> dict:
        """A streamed request: ``on_tokens`` gets each event's new tokens (``meta_info``'s
        ``completion_tokens`` counts them, so cumulative and incremental ``output_ids`` both
        work); returns the last event, the whole result. Connection errors and 5xx answers
        before the first token are retried like ``request``'s."""
        last = None
        for attempt in range(self.max_retries + 1):
            seen = 0
            try:
                async with self._client().post(address + endpoint, json=payload) as resp:
                    if 400 <= resp.status < 500:
                        raise InferenceError(
                            f"server {address}{endpoint} refused the request ({resp.status}): "
                            f"{await resp.text()}"
                        )
                    if resp.status < 400:
                        async for line in resp.content:
                            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                                continue
                            event = json.loads(line[5:])
                            if "error" in event:  # the server failed mid-stream: not retried
                                raise InferenceError(
                                    f"server {address}{endpoint} failed: {event['error']}"
                                )
                            fresh = event["meta_info"]["completion_tokens"] - seen
                            if fresh > 0:
                                on_tokens(event["output_ids"][-fresh:])
                                seen += fresh
                            if event["meta_info"].get("finish_reason") is not None:
                                return event
                        last = "the stream ended before the result"
                    else:
                        last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if seen or attempt == self.max_retries:  # tokens already passed on: not replayed
                break
            await asyncio.sleep(self.backoff_s * 2**attempt)
        raise InferenceError(f"server {address}{endpoint} streamed no result: {last}")

    async def agenerate_n(self, req: ModelRequest, n: int) -> list[ModelResponse]:
        """``n`` samples of one prompt in one request (SGLang's ``sampling_params.n``); a sample
        aborted by a weight update is resumed on its own."""
        req = _episode_seeded(req)
        address = self.pick_server(req.session_id)
        self._in_flight[address] += n
        try:
            first = await self.request(address, *self.protocol.generate(req, ModelResponse(), n))
            outs = []
            for i, result in enumerate(self.protocol.samples(first, n)):
                out = ModelResponse(input_tokens=list(req.input_ids))
                reason = self.protocol.absorb(out, result)
                sample = (
                    req
                    if n == 1
                    else ModelRequest(req.input_ids, req.gconfig.seeded(i), f"{req.rid}-{i}")
                )
                outs.append(self._resume(address, sample, out, reason))
            return list(await asyncio.gather(*outs))
        finally:
            self._in_flight[address] -= n

    async def _resume(
        self, address: str, req: ModelRequest, out: ModelResponse, reason: str | None
    ) -> ModelResponse:
        while reason not in ("stop", "length") and out.output_len < req.gconfig.max_new_tokens:
            await asyncio.sleep(self.resume_delay_s)
            answer = await self.request(address, *self.protocol.generate(req, out, 1))
            reason = self.protocol.absorb(out, self.protocol.samples(answer, 1)[0])
        out.stop_reason = "length" if reason in (None, "abort") else reason
        return out

    # -- the weight-update cycle -----------------------------------------------------------

    async def pause(self, mode: str = "abort") -> None:
        """``abort``: in-flight requests return and are resubmitted with their tokens so far;
        ``in_place``: they wait, with their KV cache, and continue on the new weights."""
        endpoint, payload, params = self.protocol.pause(mode)
        await asyncio.gather(
            *(self.request(a, endpoint, payload, params=params) for a in self.addresses)
        )

    async def resume(self) -> None:
        await asyncio.gather(*(self.request(a, *self.protocol.resume()) for a in self.addresses))

    async def update_weights(
        self,
        version: int,
        model_path: str | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
        pause_mode: str = "abort",
    ) -> None:
        """pause → update (from a directory, or tensors sent in the request body) → continue,
        on every server."""
        if (model_path is None) == (state_dict is None):
            raise ValueError("update_weights: give exactly one of model_path and state_dict")
        if state_dict is not None and not self.protocol.supports_tensors:
            raise ValueError(
                f"update_weights: {self.protocol.name} servers load weights from a folder; "
                "give model_path"
            )
        await self.pause(pause_mode)
        try:
            if model_path is not None:
                for endpoint, payload in self.protocol.update_from_disk(model_path, version):
                    await asyncio.gather(
                        *(self.request(a, endpoint, payload) for a in self.addresses)
                    )
            else:
                blob = save({k: v.detach().contiguous().cpu() for k, v in state_dict.items()})
                await asyncio.gather(
                    *(
                        self.request(
                            a,
                            "/update_weights_from_tensors",
                            content=blob,
                            params={"weight_version": version},
                        )
                        for a in self.addresses
                    )
                )
        finally:
            await self.resume()
