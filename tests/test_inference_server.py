"""The inference server's defences (weight updates, connections, bad values) and its SGLang
compatibility (router defaults, text prompts, refused fields, a real sglang-router)."""

import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
import torch
from deps import require
from safetensors.torch import save
from transformers import AutoTokenizer

from tidal.inference import (
    GenerationConfig,
    GenerationEngine,
    InferenceClient,
    InferenceServer,
    ModelRequest,
    WeightsRejected,
)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = InferenceServer(
        GenerationEngine(model_dir), header_timeout_s=0.5, body_timeout_s=0.5
    ).start()
    yield srv
    srv.stop()


def post(server, path, body=None, **kw):
    if isinstance(body, bytes):
        return httpx.post(
            server.address + path,
            content=body,
            headers={"content-type": "application/json"},
            timeout=30,
            **kw,
        )
    return httpx.post(server.address + path, json=body, timeout=30, **kw)


def greedy(server, prompt=(1, 5, 9), n=12):
    body = {
        "input_ids": list(prompt),
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    resp = post(server, "/generate", body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    del out["meta_info"]["id"]  # a fresh id per request
    return out


# -- weight updates -------------------------------------------------------------------------


def _bad_updates(state):
    keys = list(state)
    one = {keys[0]: state[keys[0]] + 1}
    shape = {k: v + 1 for k, v in state.items()}
    shape[keys[-1]] = torch.zeros(3, 3)
    nan = {k: v + 1 for k, v in state.items()}
    nan[keys[1]] = nan[keys[1]].clone()
    nan[keys[1]][0, 0] = float("nan")
    ints = {k: v + 1 for k, v in state.items()}
    ints[keys[2]] = ints[keys[2]].to(torch.int32)
    extra = {**{k: v + 1 for k, v in state.items()}, "extra_head.bias": torch.zeros(3)}
    return {
        "one tensor": (one, "missing keys"),
        "wrong shape": (shape, "shape"),
        "nan": (nan, "non-finite"),
        "int dtype": (ints, "dtype"),
        "unexpected key": (extra, "unexpected"),
    }


def test_a_refused_weight_update_changes_nothing_and_is_a_400(server):
    before = {k: v.clone() for k, v in server.engine.state_dict().items()}
    version, output = server.engine.weight_version, greedy(server)
    for case, (update, reason) in _bad_updates(before).items():
        assert post(server, "/pause_generation", {}).status_code == 200
        try:
            resp = post(
                server,
                "/update_weights_from_tensors",
                save(update),
                params={"weight_version": version + 1},
            )
        finally:
            post(server, "/continue_generation", {})
        assert resp.status_code == 400 and reason in resp.json()["error"], (case, resp.text)
        after = server.engine.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), case
        assert server.engine.weight_version == version
    assert greedy(server) == output


def test_the_trainer_path_refuses_nan_weights_too(model_dir):
    """``InferenceServerWorker.update_weights`` (the runner's path) and ``load_weights`` call
    ``engine.update_weights``: the same checks."""
    from tidal.workers.inference_worker import InferenceServerWorker

    for method in (InferenceServerWorker.update_weights, InferenceServerWorker.load_weights):
        assert "engine.update_weights(update.state_dict" in _source(method)
    engine = GenerationEngine(model_dir)
    try:
        state = {k: v.clone() for k, v in engine.state_dict().items()}
        poisoned = {k: torch.full_like(v, float("inf")) for k, v in state.items()}
        engine.pause()
        with pytest.raises(WeightsRejected, match="non-finite"):
            engine.update_weights(poisoned, 3)
        assert engine.weight_version == 0
        assert all(torch.equal(state[k], v) for k, v in engine.state_dict().items())
        engine.update_weights(
            {k: v.to(torch.bfloat16) for k, v in state.items()}, 4
        )  # precision may change
        assert engine.weight_version == 4
    finally:
        engine.close()


def test_the_fused_finiteness_check_names_the_bad_tensor_and_never_overflows():
    from tidal.inference.engine import first_non_finite

    big = torch.full((1000,), 6e4, dtype=torch.float16)  # finite; a plain fp16 sum overflows
    huge = torch.full((1000,), 3e38)  # finite; a plain fp32 sum overflows
    ok = {"a": big, "b": huge, "c": torch.randn(3, dtype=torch.bfloat16), "i": torch.arange(3)}
    assert first_non_finite(ok) is None
    for bad in (float("nan"), float("inf"), float("-inf")):
        poisoned = {**ok, "d": torch.tensor([1.0, bad]), "e": torch.tensor([bad])}
        assert first_non_finite(poisoned) == "d"


def _source(fn):
    import inspect

    return inspect.getsource(fn)


# -- bad values -----------------------------------------------------------------------------


def test_a_tiny_temperature_is_greedy_and_never_a_500(server):
    reference = greedy(server)
    for temperature in (1e-45, 1e-30, 1e-7):
        body = {
            "input_ids": [1, 5, 9],
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": 12,
                "temperature": temperature,
                "ignore_eos": True,
            },
        }
        resp = post(server, "/generate", body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["output_ids"] == reference["output_ids"]
        got = [lp for lp, _, _ in resp.json()["meta_info"]["output_token_logprobs"]]
        want = [lp for lp, _, _ in reference["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize(
    "raw,field",
    [
        (b'{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}', "temperature"),
        (b'{"input_ids": [1, 2], "sampling_params": {"temperature": Infinity}}', "temperature"),
        (b'{"input_ids": [1, 2], "sampling_params": {"top_p": NaN}}', "top_p"),
        (b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "5"}}', "max_new_tokens"),
        (b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": true}}', "max_new_tokens"),
        (b'{"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [-1]}}', "stop_token_ids"),
        (b'{"input_ids": [1, 2], "sampling_params": {"beam_width": 4}}', "beam_width"),
        (b'{"input_ids": [1, 2.5]}', "input_ids"),
        (b"[1, 2]", "body"),
    ],
)
def test_bad_values_are_400s_naming_the_field(server, raw, field):
    resp = post(server, "/generate", raw)
    assert resp.status_code == 400 and field in resp.json()["error"], resp.text


def test_a_prompt_longer_than_the_context_is_named_as_such(server):
    context = server.engine.max_positions
    resp = post(server, "/generate", {"input_ids": [1] * (context + 10)})
    assert resp.status_code == 400
    message = resp.json()["error"]
    assert (
        "prompt has" in message
        and "longer than the model's context" in message
        and str(context) in message
    )
    resp = post(
        server, "/generate", {"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": context}}
    )
    assert resp.status_code == 400 and f"at most {context - 10} fit" in resp.json()["error"]


# -- connections ----------------------------------------------------------------------------


def test_half_sent_requests_are_closed_after_their_bound(server):
    headers_only = socket.create_connection((server.host, server.port))
    slow_body = socket.create_connection((server.host, server.port))
    try:
        headers_only.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
        slow_body.sendall(
            b'POST /generate HTTP/1.1\r\nHost: x\r\ncontent-length: 100\r\n\r\n{"input'
        )
        for sock in (headers_only, slow_body):
            sock.settimeout(5)
            start = time.monotonic()
            data = sock.recv(1024)
            while data:  # the server may answer (408-like) before closing; wait for the close
                data = sock.recv(1024)
            assert time.monotonic() - start < 3
    finally:
        headers_only.close()
        slow_body.close()
    assert httpx.get(server.address + "/health", timeout=5).json() == {"status": "ok"}


SERVE_WITH_128_FDS = textwrap.dedent("""
    import resource, sys, time
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
    from tidal.inference import GenerationEngine, InferenceServer
    server = InferenceServer(GenerationEngine(sys.argv[1])).start()
    print(server.port, flush=True)
    time.sleep(120)
""")


def test_idle_connections_cannot_starve_health_at_a_128_descriptor_limit(model_dir):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_WITH_128_FDS, str(model_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    idle = []
    try:
        port = int(proc.stdout.readline())
        for _ in range(150):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"GET /health HTTP/1.1\r\n")  # half a request, never finished
            idle.append(sock)
        start = time.monotonic()
        resp = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        assert resp.json() == {"status": "ok"} and time.monotonic() - start < 2
    finally:
        for sock in idle:
            sock.close()
        proc.kill()
        _, stderr = proc.communicate(timeout=10)
    assert "Too many open files" not in stderr  # the server never ran out of descriptors


# -- client routing -------------------------------------------------------------------------


def test_requests_without_a_session_go_to_the_least_loaded_server(model_dir):
    servers = [InferenceServer(GenerationEngine(model_dir)).start() for _ in range(2)]

    async def main():
        c = InferenceClient([s.address for s in servers])
        try:
            busy = asyncio.create_task(
                c.agenerate(ModelRequest([1, 4], GenerationConfig(max_new_tokens=120)))
            )
            await asyncio.sleep(0.05)
            first = c.pick_server()  # one request in flight on server 0: the other is less loaded
            sticky = {c.pick_server("episode-7") for _ in range(5)}
            await asyncio.gather(
                *(
                    c.agenerate(ModelRequest([1, 5 + i], GenerationConfig(max_new_tokens=4)))
                    for i in range(7)
                )
            )
            await busy
            return first, sticky
        finally:
            await c.aclose()

    try:
        first, sticky = asyncio.run(main())
        assert first == servers[1].address and len(sticky) == 1
        assert [s.engine.stats["requests"] for s in servers] == [4, 4]
    finally:
        for s in servers:
            s.stop()


# -- SGLang compatibility -------------------------------------------------------------------

ROUTER_DEFAULTS = {
    "model": "tidal",
    "stream": False,
    "return_text_in_logprobs": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}


def test_sglang_router_defaults_and_frontend_sampling_fields_are_accepted(server, model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    body = {
        **ROUTER_DEFAULTS,
        "text": "12+3=",
        "sampling_params": {
            "max_new_tokens": 8,
            "temperature": 0,
            "skip_special_tokens": True,
            "spaces_between_special_tokens": True,
            "no_stop_trim": False,
        },
    }
    resp = post(server, "/generate", body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["meta_info"]["prompt_tokens"] == len(tok("12+3=").input_ids)
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)
    same = post(
        server,
        "/generate",
        {
            "input_ids": tok("12+3=").input_ids,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        },
    ).json()
    assert same["output_ids"] == out["output_ids"]


def test_batched_text_prompts_answer_in_order(server):
    texts = ["1+1=", "abc", "9*9="]
    resp = post(
        server,
        "/generate",
        {"text": texts, "sampling_params": {"max_new_tokens": 5, "temperature": 0, "n": 2}},
    )
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert len(out) == 6 and all("text" in o for o in out)
    for i, text in enumerate(texts):
        single = post(
            server,
            "/generate",
            {"text": text, "sampling_params": {"max_new_tokens": 5, "temperature": 0}},
        )
        assert (
            out[2 * i]["output_ids"] == out[2 * i + 1]["output_ids"] == single.json()["output_ids"]
        )


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"sampling_params": {"min_new_tokens": 4}}, "min_new_tokens"),
        ({"sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
        ({"sampling_params": {"repetition_penalty": 1.2}}, "repetition_penalty"),
        ({"sampling_params": {"regex": "[0-9]+"}}, "regex"),
        ({"sampling_params": {"json_schema": "{}"}}, "json_schema"),
        ({"stream": True, "sampling_params": {"n": 2}}, "stream"),
        ({"return_hidden_states": True}, "return_hidden_states"),
        ({"lora_path": "adapter"}, "lora_path"),
    ],
)
def test_fields_that_would_change_generation_are_refused_by_name(server, extra, field):
    resp = post(server, "/generate", {"input_ids": [1, 2], **extra})
    assert resp.status_code == 400 and field in resp.json()["error"], resp.text


def test_a_streamed_generate_sends_new_tokens_then_the_whole_result(server):
    body = {
        "input_ids": [1, 5, 9],
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    whole = post(server, "/generate", body).json()
    with httpx.stream("POST", server.address + "/generate", json={**body, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    *progress, last = events
    assert [t for e in progress for t in e["output_ids"]] == whole["output_ids"]
    assert [e["meta_info"]["completion_tokens"] for e in progress][-1] == 12
    assert all(e["meta_info"]["finish_reason"] is None for e in progress)
    assert last["output_ids"] == whole["output_ids"]
    assert last["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


def test_stop_strings_end_the_text_and_eos_is_honoured_unless_ignored(server, model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = {
        "input_ids": [1, 5, 9],
        "sampling_params": {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True},
    }
    ids = post(server, "/generate", base).json()["output_ids"]
    k = next(i for i in range(4, 30) if ids[i] >= 3)  # an ordinary character, not a special token
    first = ids.index(ids[k])
    stop = tok.decode([ids[k]])
    body = {**base, "sampling_params": {**base["sampling_params"], "stop": [stop]}}
    out = post(server, "/generate", body).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == ids[: first + 1]
    assert out["text"] == tok.decode(ids[:first], skip_special_tokens=True)
    kept = post(
        server,
        "/generate",
        {**body, "sampling_params": {**body["sampling_params"], "no_stop_trim": True}},
    )
    assert kept.json()["text"] == tok.decode(ids[: first + 1], skip_special_tokens=True)
    # like SGLang, generation stops at the tokenizer's EOS unless ignore_eos (tidal's client sends it)
    eos_first = {
        "input_ids": [1, 5, 9],
        "sampling_params": {"max_new_tokens": 30, "temperature": 0, "stop_token_ids": [ids[k]]},
    }
    ended = post(server, "/generate", eos_first).json()
    assert ended["output_ids"] == ids[: first + 1] or tok.eos_token_id in ended["output_ids"]
    from tidal.inference.protocol import parse_generate

    assert parse_generate(eos_first, tok).configs[0].stop_token_ids == [ids[k], tok.eos_token_id]
    assert parse_generate(base, tok).configs[0].stop_token_ids == []


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_real_sglang_router_serves_generate_from_two_tidal_servers(model_dir):
    require("sglang_router")
    servers = [InferenceServer(GenerationEngine(model_dir)).start() for _ in range(2)]
    port = _free_port()
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--worker-urls",
            *[s.address for s in servers],
            "--port",
            str(port),
            "--policy",
            "round_robin",
            "--log-level",
            "error",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and router.poll() is None, (
                "the router did not come up"
            )
            time.sleep(0.1)
        direct = post(
            servers[0],
            "/generate",
            {"text": "7*8=", "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
        )
        answers = [
            httpx.post(
                url + "/generate",
                json={"text": "7*8=", "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
                timeout=30,
            )
            for _ in range(4)
        ]
        assert all(a.status_code == 200 for a in answers), answers[0].text
        assert {a.json()["text"] for a in answers} == {direct.json()["text"]}
        assert [s.engine.stats["requests"] for s in servers] == [3, 2]  # round robin over both
        ids = httpx.post(
            url + "/generate",
            json={
                "input_ids": [1, 4, 4],
                "return_logprob": True,
                # sampled: without ignore_eos an EOS drawn early ends it short (a flake in CI)
                "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
            },
            timeout=30,
        ).json()
        assert len(ids["meta_info"]["output_token_logprobs"]) == 3
        assert (
            httpx.post(
                url + "/generate",
                json={"input_ids": [1, 2], "sampling_params": {"min_p": 0.3}},
                timeout=30,
            ).status_code
            == 400
        )
    finally:
        router.terminate()
        router.wait(10)
        for s in servers:
            s.stop()
