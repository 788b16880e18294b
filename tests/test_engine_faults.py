"""The generation engine under faults: a thread that dies, callers that go away, aborts."""

import asyncio
import time

import httpx
import pytest
from engine_faults import engine_that_dies_on_pass, engine_with_slow_passes

from tidal.inference import (
    GenerationConfig,
    InferenceClient,
    InferenceError,
    InferenceServer,
    ModelRequest,
)
from tidal.inference.engine import EngineDied
from tidal.inference.protocol import generate_all


def test_an_engine_whose_thread_dies_fails_every_request_naming_the_error(model_dir):
    """The engine's forward raises mid-generation (a CUDA fault, a model bug): the streamed
    request in it, later ones in-process and over HTTP, and a pause all fail naming the error;
    none waits for ever."""
    engine = engine_that_dies_on_pass(model_dir, 3)
    srv = InferenceServer(engine).start()
    streamed: list[int] = []

    async def ask(on_tokens=None):
        c = InferenceClient([srv.address], max_retries=1, backoff_s=0.05)
        try:
            req = ModelRequest([1, 2], GenerationConfig(max_new_tokens=10))
            await c.agenerate(req, on_tokens)
        finally:
            await c.aclose()

    try:
        with pytest.raises(InferenceError, match="failed: the generation engine stopped .*CUDA"):
            asyncio.run(asyncio.wait_for(ask(streamed.extend), 30))
        assert len(streamed) == 2  # what it generated before its thread died
        jobs = [([1, 2, 3], GenerationConfig(max_new_tokens=4), None)] * 3
        with pytest.raises(EngineDied, match="RuntimeError: CUDA error: an illegal memory"):
            asyncio.run(asyncio.wait_for(generate_all(engine, jobs), 30))
        with pytest.raises(EngineDied, match="illegal memory access"):
            engine.submit([1, 2], GenerationConfig(max_new_tokens=2), lambda result: None)
        with pytest.raises(EngineDied):
            engine.pause(timeout=5)
        with pytest.raises(InferenceError, match="HTTP 500.*illegal memory access"):
            asyncio.run(asyncio.wait_for(ask(), 30))
    finally:
        srv.stop()


def test_a_caller_that_goes_away_frees_its_rows_in_the_engine(model_dir):
    """A generation whose caller went away leaves the batch at the next step instead of running
    on to its 200 tokens, and the engine serves on: a callback that raises (the caller's event
    loop closed), a cancelled caller in process, a closed stream over HTTP, and an HTTP client
    that stopped waiting for a whole answer."""
    engine = engine_with_slow_passes(model_dir, 0.02)  # 200 tokens: ~4 s each
    srv = InferenceServer(engine).start()
    long = {"max_new_tokens": 200}

    def cancelled_soon(count: int) -> None:
        deadline = time.monotonic() + 5
        while engine.stats["cancelled"] < count:
            assert time.monotonic() < deadline, f"not cancelled: {engine.stats}"
            time.sleep(0.01)

    async def cancel_after_three_tokens():
        tokens, enough = [], asyncio.Event()

        def on_token(token):
            tokens.append(token)
            if len(tokens) == 3:
                enough.set()

        job = ([1, 2], GenerationConfig(**long), None)
        task = asyncio.create_task(generate_all(engine, [job], on_token))
        await asyncio.wait_for(enough.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    def loop_closed(token):
        raise RuntimeError("Event loop is closed")

    try:
        results = []
        engine.submit([1, 2], GenerationConfig(**long), results.append, on_token=loop_closed)
        deadline = time.monotonic() + 5
        while not results:
            assert time.monotonic() < deadline, f"not cancelled: {engine.stats}"
            time.sleep(0.01)
        assert results[0].finish_reason == "abort" and len(results[0].output_ids) == 1
        asyncio.run(cancel_after_three_tokens())
        cancelled_soon(2)
        # the server stops at EOS unless told not to: a random model may draw it at once
        body = {
            "input_ids": [1, 2],
            "sampling_params": {**long, "ignore_eos": True},
            "stream": True,
        }
        with httpx.stream("POST", srv.address + "/generate", json=body, timeout=30) as resp:
            next(line for line in resp.iter_lines() if line.startswith("data:"))
        cancelled_soon(3)
        body["stream"] = False  # a client that gives up waiting for a whole answer
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.address + "/generate", json=body, timeout=httpx.Timeout(30, read=0.3))
        cancelled_soon(4)
        assert engine.stats["generated_tokens"] < 200  # of the 800 the four asked for
        (result,) = asyncio.run(
            generate_all(engine, [([1, 2], GenerationConfig(max_new_tokens=3), None)])
        )
        assert len(result.output_ids) == 3
        assert engine.stats["aborted"] == 0  # no pause aborted anything
    finally:
        srv.stop()


def test_abort_ends_its_own_request_queued_or_running(model_dir):
    """``Submitted.abort`` ends that request and no other with its id: one queued during a
    pause never starts; one running leaves the batch; the one beside it runs to its end."""
    engine = engine_with_slow_passes(model_dir, 0.01)
    results: dict = {}

    def keep(name):
        return lambda result: results.__setitem__(name, result)

    long = GenerationConfig(max_new_tokens=100)
    try:
        engine.pause("in_place")
        engine.submit([1, 2], long, keep("queued"), rid="same").abort()
        engine.resume()
        running = engine.submit([1, 2], long, keep("running"), rid="same")
        engine.submit([3, 4], GenerationConfig(max_new_tokens=20), keep("other"), rid="same")
        deadline = time.monotonic() + 30
        while engine.stats["generated_tokens"] < 6:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        running.abort()
        while len(results) < 3:
            assert time.monotonic() < deadline, results
            time.sleep(0.005)
    finally:
        engine.close()
    assert results["queued"].finish_reason == "abort" and results["queued"].output_ids == []
    assert results["running"].finish_reason == "abort"
    assert 0 < len(results["running"].output_ids) < 100
    assert results["other"].finish_reason == "length" and len(results["other"].output_ids) == 20
    assert (engine.stats["cancelled"], engine.stats["aborted"]) == (2, 0)


def test_an_engine_that_dies_in_a_prefill_answers_the_requests_it_was_admitting(model_dir):
    engine = engine_that_dies_on_pass(model_dir, 2)  # the second request's prefill
    first = asyncio.run(generate_all(engine, [([1, 2], GenerationConfig(max_new_tokens=1), None)]))
    assert len(first[0].output_ids) == 1
    with pytest.raises(EngineDied, match="illegal memory access"):
        asyncio.run(
            asyncio.wait_for(generate_all(engine, [([3, 4], GenerationConfig(), None)]), 10)
        )
