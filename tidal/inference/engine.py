"""An embedded generation engine for Hugging Face causal language models, with continuous batching.

Requests join the running batch between decode steps and leave when done. The batch keeps
one KV cache whose rows are left-padded to a common length; the requests waiting to join are
prefilled together (left-padded) and their cache padded in, a finished one is dropped by index.

Log-probabilities: for every generated token the engine reports
``log_softmax(logits / temperature)[token]`` — the temperature-scaled distribution *before*
top-k / top-p filtering (``log_softmax(logits)`` when greedy, i.e. ``temperature`` below ``GREEDY_TEMPERATURE``). A
trainer recomputes the same number from a forward pass of the same weights.

``pause("abort")`` aborts every in-flight request — each finishes with what it generated so
far and ``finish_reason == "abort"`` (the client resubmits it with its tokens so far) — and holds
new requests until ``resume()``. ``pause("in_place")`` (SGLang's name) only stops decoding: the
in-flight requests keep their KV cache and continue after ``resume()``, with the new weights on
top of a cache the old weights computed — nothing is prefilled twice, at the price of that
mixed state (which the decoupled loss's proximal policy is there to absorb). Weights change only
while paused; every token is stamped with the weight version that sampled it.

A request whose caller went away (``Submitted.abort``: ``protocol.generate_all`` cancelled, as
when a client closes its stream) leaves the batch before the next step. If the engine's thread
dies, every request in it and every later one fails with ``EngineDied``, naming the error.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tidal.extras import needs_extra
from tidal.models.gguf import load_pretrained, model_folder

with needs_extra("llm", "the generation engine"):
    from transformers import DynamicCache

from tidal.inference.kv_cache import (
    PromptCache,
    cache_key,
    cache_nbytes,
    keep_rows,
    last_logits_only,
    left_padded,
    merge_caches,
    row_layers,
    stack_rows,
)
from tidal.inference.params import GenerationConfig, check_request
from tidal.inference.sampling import sample_tokens
from tidal.runtime.weight_sync.validation import (  # noqa: F401 (re-exported)
    WeightsRejected,
    check_weights,
    first_non_finite,
    load_checked,
)

log = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: int
    prompt_tokens: int
    matched_stop: int | str | None = None  # the stop token id or stop string
    output_versions: list[int] = field(default_factory=list)  # the weight version of each token
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # if asked for


class EngineError(RuntimeError):
    pass


class EngineDied(EngineError):
    """The engine's thread ended on an error: every request in it and every later one fails
    with this, naming the cause (none waits for an answer that cannot come)."""


PAUSE_MODES = ("abort", "in_place")
PREFILL_CHUNK = 32  # requests prefilled in one forward pass


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    params: GenerationConfig
    on_done: Callable[[GenerationResult | EngineDied], None]
    generator: torch.Generator | None = None
    on_token: Callable[[int], None] | None = None  # called with each new token (streaming)
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    next_token: int | None = None
    aborted: bool = False  # its caller went away (``Submitted.abort``, from any thread)


@dataclass(frozen=True)
class Submitted:
    """A request in the engine: its id, and ``abort()`` for a caller that went away (a queued
    request never starts; a running one leaves the batch before the next step and returns
    what it has, ``finish_reason`` ``abort``). Thread-safe; after the end, a no-op."""

    rid: str
    _request: _Request
    _wake: threading.Event

    def abort(self) -> None:
        self._request.aborted = True
        self._wake.set()


class GenerationEngine:
    def __init__(
        self,
        model_dir: str | Path,
        max_batch_size: int = 64,
        dtype: torch.dtype = torch.float32,
        weight_version: int = 0,
        device: torch.device | str = "cpu",
        prompt_cache: int = 64,
    ):
        self.model_dir = model_folder(model_dir)  # a GGUF file or packaged model: its folder
        self.device = torch.device(device)
        self.model = load_pretrained(self.model_dir, dtype=dtype)
        self.model.to(self.device).eval()
        self._cache_key = cache_key(self.model)
        # a prefill samples from its last position only: the head's [B, L, vocab] logits
        # over the whole prompt would cost memory (1.3 GB at 64 x 100 tokens x 49k vocab)
        self._last_logits = last_logits_only(self.model)
        self.vocab_size = self.model.config.vocab_size
        self.max_positions = getattr(self.model.config, "max_position_embeddings", 4096)
        self.tokenizer = optional_tokenizer(self.model_dir)  # None when the folder has none
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        self._incoming: queue.Queue[_Request] = queue.Queue()
        self._active: list[_Request] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # [B, L] 1 where the cache holds a real token
        self._paused = threading.Event()
        self._pause_mode = "abort"
        self._idle = threading.Event()  # set while paused and nothing is being generated
        self._lock = threading.Lock()  # model forward vs weight update
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._died: EngineDied | None = None
        self._joining: list[_Request] = []  # being prefilled: not in the batch yet
        self._prompts = PromptCache(prompt_cache)  # recent prompts' cache rows, these weights
        # aborted: by a pause (resubmitted by clients); cancelled: by their callers
        self.stats = {
            "generated_tokens": 0,
            "prefilled_tokens": 0,  # prompt tokens through the model (a shared prompt once)
            "requests": 0,
            "aborted": 0,
            "cancelled": 0,
        }
        self._thread = threading.Thread(target=self._loop, name="tidal-engine", daemon=True)
        self._thread.start()

    # -- public API (thread-safe) ---------------------------------------------------------

    def submit(
        self,
        prompt: list[int],
        params: GenerationConfig,
        on_done: Callable[[GenerationResult | EngineDied], None],
        rid: str | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> Submitted:
        """Queue a request; ``on_done(result)`` (and ``on_token(token)`` for every token) run on
        the engine's thread and must be quick. ``on_done`` gets an ``EngineDied`` instead of a
        result if the engine's thread ends on an error first. A callback that raises (its
        caller's event loop closed) aborts its request, never the engine. Returns the request's
        id and its ``abort()``."""
        self.validate(prompt, params)
        rid = rid or uuid.uuid4().hex
        gen = None
        if not params.greedy:  # its own generator: the process's global one is left alone
            gen = torch.Generator()
            gen.manual_seed(params.seed) if params.seed is not None else gen.seed()
        req = _Request(rid, list(prompt), params, on_done, gen, on_token)
        self._incoming.put(req)
        self._wake.set()
        if self._died is not None:  # it died while this one was queued: answer it too
            self._fail_waiting()
        return Submitted(rid, req, self._wake)

    def validate(self, prompt: list[int], params: GenerationConfig) -> None:
        """Refuse what cannot be generated, naming the field (the server answers 400), and
        everything once the engine died (``EngineDied``, a 500)."""
        if self._died is not None:
            raise self._died
        check_request(prompt, params, self.vocab_size, self.max_positions, self.tokenizer)

    def pause(self, mode: str = "abort", timeout: float = 60.0) -> None:
        """Stop generating: ``abort`` returns every in-flight request with what it has,
        ``in_place`` keeps them (and their cache) for ``resume()``. New requests wait."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode: expected one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        if self._died is not None:
            raise self._died
        self._pause_mode = mode
        self._paused.set()
        self._wake.set()
        if not self._idle.wait(timeout):
            raise EngineError(f"the engine did not pause within {timeout:g} s")
        if self._died is not None:
            raise self._died

    def resume(self) -> None:
        self._idle.clear()
        self._paused.clear()
        self._wake.set()

    @property
    def paused(self) -> bool:
        return self._paused.is_set()

    def update_weights(
        self, state_dict: dict[str, torch.Tensor], weight_version: int, adopt: bool = False
    ) -> None:
        """Load new weights (only while paused) and stamp later tokens with ``weight_version``.
        Every tensor is checked before any is loaded: a refused update changes nothing.
        ``adopt``: the tensors are this engine's own (``WeightsUpdate.owned``), used in place."""
        if not self._paused.is_set():
            raise EngineError("weights can only be updated while generation is paused")
        with self._lock:
            load_checked(self.model, state_dict, adopt=adopt)
            self._prompts.clear()  # computed by the old weights
            self.weight_version = weight_version

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def release_memory(self) -> int:
        """With no request in flight: drop the KV cache and return the CUDA allocator's cached
        blocks (a collocated trainer takes the device); returns the bytes the cache held."""
        with self._lock:
            if self._active:
                return 0
            held = cache_nbytes(self._cache)
            self._cache, self._mask = None, None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return held

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    # -- the loop -------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # the thread's end: every waiter is told why
            log.exception("the generation engine's thread died")
            self._died = EngineDied(
                f"the generation engine stopped on an error: {type(exc).__name__}: {exc}"
            )
            self._idle.set()  # a pause waiting for the loop ends, with this error
            joining = [r for r in self._joining if not any(r is a for a in self._active)]
            for req in self._active + joining:  # a prefill may have been what failed
                _notify(req, req.on_done, self._died)
            self._active, self._joining = [], []
            self._fail_waiting()

    def _fail_waiting(self) -> None:
        while True:
            try:
                req = self._incoming.get_nowait()
                _notify(req, req.on_done, self._died)
            except queue.Empty:
                return

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self._paused.is_set():
                with self._lock:
                    if self._pause_mode == "abort":
                        self._abort_all()
                    self._drop_aborted()  # cancelled during an in-place pause: free their rows
                self._idle.set()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            self._admit()
            if not self._active:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            with self._lock:
                self._drop_aborted()
                if self._active:
                    self._decode_step()

    def _admit(self) -> None:
        """Prefill the waiting requests that fit in the batch, ``PREFILL_CHUNK`` at a time (a
        pause waits for at most one chunk)."""
        while not self._paused.is_set():
            joining = []
            while len(joining) < min(PREFILL_CHUNK, self.max_batch_size - len(self._active)):
                try:
                    req = self._incoming.get_nowait()
                except queue.Empty:
                    break
                if req.aborted:  # its caller went away before it started
                    self._complete(req, "abort", None)
                else:
                    joining.append(req)
            if not joining:
                return
            self._joining = joining
            with self._lock:
                self._prefill(joining)
                self._drop_finished()  # a request may be done after its first token
            self._joining = []

    @torch.no_grad()
    def _prefill(self, reqs: list[_Request]) -> None:
        """The joining requests' prompts through the model, each distinct prompt once: one
        computed for earlier requests with these weights comes from the prompt cache (a GRPO
        group's samples share theirs), the others are prefilled together."""
        rows = {tuple(r.prompt): self._prompts.get(tuple(r.prompt)) for r in reqs}
        missing = [p for p, row in rows.items() if row is None]
        if missing:
            rows.update(self._compute_prompts(missing))
        picked = [rows[tuple(r.prompt)] for r in reqs]
        cache, mask = stack_rows([layers for layers, _ in picked], [len(r.prompt) for r in reqs])
        logits = torch.stack([last for _, last in picked])
        tokens, logprobs, tops = sample_tokens(logits.float(), reqs)
        self.stats["requests"] += len(reqs)
        self._join(reqs, cache, mask)
        for req, tok, lp, top in zip(reqs, tokens.tolist(), logprobs.tolist(), tops):
            self._accept(req, tok, lp, top)

    def _compute_prompts(self, prompts: list[tuple[int, ...]]) -> dict:
        """``prompts`` through the model at once (left-padded): each one's unpadded cache row
        and last logits, kept in the prompt cache too."""
        ids, mask, positions = left_padded(prompts, self.device)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **self._last_logits,
        )
        self.stats["prefilled_tokens"] += sum(len(p) for p in prompts)
        cache, rows = getattr(out, self._cache_key), {}
        for i, prompt in enumerate(prompts):
            rows[prompt] = (row_layers(cache, i, len(prompt)), out.logits[i, -1].clone())
            self._prompts.put(prompt, *rows[prompt])
        return rows

    def _join(self, reqs: list[_Request], cache: DynamicCache, mask: torch.Tensor) -> None:
        """The new requests' cache merged into the batch's (a fresh batch if none runs)."""
        if not self._active:
            self._cache = self._mask = None
        self._cache, self._mask = merge_caches(self._cache, self._mask, cache, mask)
        self._active.extend(reqs)

    @torch.no_grad()
    def _decode_step(self) -> None:
        batch = self._active
        ids = torch.tensor([[r.next_token] for r in batch], device=self.device)
        ones = torch.ones(len(batch), 1, dtype=torch.long, device=self.device)
        self._mask = torch.cat([self._mask, ones], 1)
        positions = self._mask.sum(1, keepdim=True) - 1
        out = self.model(
            input_ids=ids,
            attention_mask=self._mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_key: self._cache},
        )
        self._cache = getattr(out, self._cache_key)
        tokens, logprobs, tops = sample_tokens(out.logits[:, -1].float(), batch)
        for req, tok, lp, top in zip(batch, tokens.tolist(), logprobs.tolist(), tops):
            self._accept(req, tok, lp, top)
        self._drop_finished()

    def _accept(self, req: _Request, token: int, logprob: float, top: list | None) -> None:
        req.output.append(token)
        if req.on_token is not None and not req.aborted:  # nobody reads an aborted one
            _notify(req, req.on_token, token)
        if top is not None:
            req.top.append(top)
        req.logprobs.append(logprob)
        req.versions.append(self.weight_version)
        req.next_token = token
        self.stats["generated_tokens"] += 1

    def _finish_reason(self, req: _Request) -> tuple[str | None, int | str | None]:
        if req.aborted:
            return "abort", None
        if req.output and req.output[-1] in req.params.stop_token_ids:
            return "stop", req.output[-1]
        if req.params.stop:
            matched = self._stop_string(req)
            if matched is not None:
                return "stop", matched
        if len(req.output) >= req.params.max_new_tokens:
            return "length", None
        return None, None

    def _stop_string(self, req: _Request) -> str | None:
        """The stop string the newest token completed, if any: decode only the tail that can
        hold one (a string of k characters spans at most k tokens, plus a few partial ones)."""
        width = max(len(s) for s in req.params.stop) + 4
        tail = self.tokenizer.decode(req.output[-width:], skip_special_tokens=False)
        # an earlier occurrence would have stopped the request already: any match is new
        return next((stop for stop in req.params.stop if stop in tail), None)

    def _drop_finished(self) -> None:
        keep = []
        for i, req in enumerate(self._active):
            reason, matched = self._finish_reason(req)
            if reason is None:
                keep.append(i)
            else:
                self._complete(req, reason, matched)
        if len(keep) == len(self._active):
            return
        self._active = [self._active[i] for i in keep]
        if not keep:
            self._cache, self._mask = None, None
            return
        self._cache, self._mask = keep_rows(self._cache, self._mask, keep)

    def _drop_aborted(self) -> None:
        """Drop the requests whose callers went away, before another step is spent on them."""
        if any(r.aborted for r in self._active):
            self._drop_finished()

    def _abort_all(self) -> None:
        for req in self._active:
            self._complete(req, "abort", None)
        self._active, self._cache, self._mask = [], None, None

    def _complete(self, req: _Request, reason: str, matched: int | None) -> None:
        if req.aborted:
            self.stats["cancelled"] += 1
        elif reason == "abort":
            self.stats["aborted"] += 1
        _notify(
            req,
            req.on_done,
            GenerationResult(
                req.rid,
                req.output,
                req.logprobs,
                reason,
                self.weight_version,
                len(req.prompt),
                matched,
                req.versions,
                req.top,
            ),
        )


def _notify(req: _Request, callback: Callable, value) -> None:
    """A caller's callback, on the engine's thread. One that raises (the caller's event loop
    closed: it went away) aborts its request and is logged; the engine serves on."""
    try:
        callback(value)
    except Exception as exc:
        if not req.aborted:
            log.warning("request %s: its callback raised %r; aborted", req.rid, exc)
        req.aborted = True


def optional_tokenizer(model_dir: str):
    """The model folder's tokenizer, or ``None`` when it has none (token-id requests only;
    ``tidal.models.llm.load_tokenizer`` is the one that insists)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError):
        return None
