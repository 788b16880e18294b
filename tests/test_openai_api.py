"""tidal's OpenAI-compatible API, driven by the official ``openai`` client."""

import asyncio
import time

import httpx
import pytest
from deps import require
from engine_faults import engine_that_dies_on_pass, engine_with_slow_passes
from transformers import AutoModelForCausalLM, AutoTokenizer

from tidal.inference import GenerationEngine, InferenceServer
from tidal.inference.tiny import save_tiny_model, tiny_llama

openai = require("openai")

KEY = "sk-test"
NAME = "tiny-chat"
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("models") / "chat", seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory, model_dir):
    path = tmp_path_factory.mktemp("models") / "v1"
    tiny_llama(
        AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size, seed=5
    ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir, other_weights):
    srv = InferenceServer(
        GenerationEngine(model_dir),
        api_key=KEY,
        served_model_name=NAME,
        allowed_dirs=[str(model_dir), str(other_weights)],
    ).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(
        base_url=server.address + "/v1", api_key=KEY, max_retries=0, timeout=60
    ) as c:
        yield c


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def generate(server, body):
    resp = httpx.post(
        server.address + "/generate",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [NAME]


def test_completion_matches_generate_with_usage_and_logprobs(client, server, tok):
    out = client.completions.create(
        model=NAME, prompt="12+3=", max_tokens=8, temperature=0, logprobs=2
    )
    ref = generate(
        server,
        {
            "text": "12+3=",
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        },
    )
    choice = out.choices[0]
    assert choice.text == ref["text"]
    assert out.usage.prompt_tokens == len(tok("12+3=").input_ids)
    assert (
        out.usage.completion_tokens
        == ref["meta_info"]["completion_tokens"]
        == len(choice.logprobs.tokens)
    )
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert choice.logprobs.token_logprobs == pytest.approx(
        [lp for lp, _, _ in ref["meta_info"]["output_token_logprobs"]]
    )
    for token, top, lp in zip(
        choice.logprobs.tokens, choice.logprobs.top_logprobs, choice.logprobs.token_logprobs
    ):
        assert len(top) == 2 and top[token] == pytest.approx(
            lp
        )  # greedy: the chosen token is the best
    assert choice.finish_reason in ("stop", "length")


def test_n_samples_seeds_and_token_id_prompts(client):
    first = client.completions.create(
        model=NAME,
        prompt=[1, 5, 9],
        max_tokens=10,
        n=3,
        seed=11,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    again = client.completions.create(
        model=NAME,
        prompt=[1, 5, 9],
        max_tokens=10,
        n=3,
        seed=11,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in again.choices] and len(set(texts)) > 1
    extra = first.choices[0].model_extra
    assert extra["prompt_token_ids"] == [1, 5, 9] and len(extra["token_ids"]) == 10
    assert first.usage.prompt_tokens == 3 and first.usage.completion_tokens == 30


def test_chat_uses_the_template_with_logprobs_and_stop(client, server, tok):
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "2+2="}]
    out = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    prompt = tok(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    ).input_ids
    ref = generate(
        server, {"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    )
    choice = out.choices[0]
    assert out.usage.prompt_tokens == len(prompt)
    assert choice.message.role == "assistant" and choice.message.content == ref["text"]
    assert len(choice.logprobs.content) == out.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 for c in choice.logprobs.content)
    # stop at a character of the greedy answer: the answer ends before it
    ids = generate(
        server,
        {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        },
    )["output_ids"]
    k = next(i for i in range(2, 12) if ids[i] >= 3)
    stop = tok.decode([ids[k]])
    stopped = client.chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stop=stop,
        extra_body={"ignore_eos": True},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == tok.decode(
        ids[: ids.index(ids[k])], skip_special_tokens=True
    )


def test_streaming_gives_the_same_text_as_it_is_generated(client):
    messages = [{"role": "user", "content": "5+5="}]
    for stop in (None, "a"):
        whole = client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=20,
            temperature=0,
            stop=stop,
            extra_body={"ignore_eos": True},
        )
        chunks = list(
            client.chat.completions.create(
                model=NAME,
                messages=messages,
                max_tokens=20,
                temperature=0,
                stop=stop,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[
            0
        ].finish_reason
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        if stop is None:  # it came in pieces
            assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1
    pieces = {0: "", 1: ""}
    for c in client.completions.create(
        model=NAME,
        prompt="ab",
        max_tokens=8,
        n=2,
        seed=4,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        pieces[c.choices[0].index] += c.choices[0].text
    whole = client.completions.create(
        model=NAME, prompt="ab", max_tokens=8, n=2, seed=4, extra_body={"ignore_eos": True}
    )
    assert [pieces[0], pieces[1]] == [c.text for c in whole.choices]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_stream_whose_engine_dies_ends_with_an_error_naming_it(model_dir, route):
    """The engine's forward raises on its sixth pass (a CUDA fault): the stream has sent what
    was generated (each choice has 4 tokens or more by then, however its prefill was batched),
    then ends with an error event, which the openai client raises (not an HTTP status: the
    headers went out). Before, the stream waited for ever for a result."""
    engine = engine_that_dies_on_pass(model_dir, 9)  # after several tokens, before the 10th
    srv = InferenceServer(engine, api_key=KEY, served_model_name=NAME).start()
    texts: list[str] = []
    try:
        with openai.OpenAI(
            base_url=srv.address + "/v1", api_key=KEY, max_retries=0, timeout=30
        ) as c:
            with pytest.raises(openai.APIError, match="EngineDied.*illegal memory access") as err:
                if route == "completions":
                    for chunk in c.completions.create(
                        model=NAME,
                        prompt="ab",
                        max_tokens=10,
                        stream=True,
                        extra_body={"ignore_eos": True},  # a random model may draw EOS at once
                    ):
                        texts.append(chunk.choices[0].text)
                else:  # two choices, one engine: both fail with it
                    for chunk in c.chat.completions.create(
                        model=NAME,
                        messages=[{"role": "user", "content": "hi"}],
                        max_tokens=10,
                        n=2,
                        stream=True,
                        extra_body={"ignore_eos": True},
                    ):
                        texts.append(chunk.choices[0].delta.content or "")
    finally:
        srv.stop()
    assert not isinstance(err.value, openai.APIStatusError)  # an event in a 200 stream
    assert "".join(texts)  # what it generated before the engine died


def test_a_client_that_stops_waiting_frees_its_rows(model_dir):
    """An unstreamed completion whose client times out is aborted in the engine at once,
    instead of generating its 200 tokens for nobody while the client retries."""
    engine = engine_with_slow_passes(model_dir, 0.02)  # 200 tokens: ~4 s
    srv = InferenceServer(engine, api_key=KEY, served_model_name=NAME).start()
    try:
        with openai.OpenAI(
            base_url=srv.address + "/v1", api_key=KEY, max_retries=0, timeout=0.3
        ) as c:
            with pytest.raises(openai.APITimeoutError):
                c.completions.create(
                    model=NAME, prompt="ab", max_tokens=200, extra_body={"ignore_eos": True}
                )
        deadline = time.monotonic() + 5
        while engine.stats["cancelled"] < 1:
            assert time.monotonic() < deadline, f"not aborted: {engine.stats}"
            time.sleep(0.01)
        assert engine.stats["generated_tokens"] < 100  # of 200
    finally:
        srv.stop()


@pytest.mark.parametrize(
    "kwargs,error,field",
    [
        ({"temperature": -1}, "BadRequestError", "temperature"),
        ({"temperature": 2, "top_p": 0}, "BadRequestError", "top_p"),
        ({"stream": True, "logprobs": True}, "BadRequestError", "stream"),
        ({"frequency_penalty": 0.5}, "BadRequestError", "frequency_penalty"),
        ({"max_tokens": 100_000}, "BadRequestError", "max_tokens"),
        ({"n": 0}, "BadRequestError", "n"),
        ({"model": "gpt-9"}, "NotFoundError", "model"),
        (
            {
                "extra_body": {
                    "tools": [{"type": "function", "function": {"name": "f"}}],
                    "tool_choice": {"type": "function", "function": {"name": "g"}},
                }
            },
            "BadRequestError",
            "tool_choice",
        ),
        ({"extra_body": {"tools": [{"type": "function"}]}}, "BadRequestError", "tools"),
    ],
)
def test_bad_requests_are_openai_errors_naming_the_field(client, kwargs, error, field):
    args = {
        "model": NAME,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **kwargs,
    }
    with pytest.raises(getattr(openai, error)) as info:
        client.chat.completions.create(**args)
    assert info.value.body["param"] == field and field in info.value.body["message"]
    assert info.value.body["type"] == "invalid_request_error"


def test_the_api_key_applies_and_a_model_without_chat_template_is_a_clear_400(server, tmp_path):
    with openai.OpenAI(base_url=server.address + "/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    plain = InferenceServer(GenerationEngine(save_tiny_model(tmp_path / "plain"))).start()
    try:
        with openai.OpenAI(base_url=plain.address + "/v1", api_key="none", max_retries=0) as c:
            with pytest.raises(openai.BadRequestError, match="no chat template"):
                c.chat.completions.create(
                    model="plain", messages=[{"role": "user", "content": "hi"}]
                )
    finally:
        plain.stop()


def test_a_completion_interrupted_by_a_weight_update_resumes_on_the_new_weights(
    server, model_dir, other_weights
):
    headers = {"Authorization": f"Bearer {KEY}"}
    v0 = server.engine.weight_version

    async def main():
        async with openai.AsyncOpenAI(
            base_url=server.address + "/v1", api_key=KEY, max_retries=0
        ) as c:
            task = asyncio.create_task(
                c.completions.create(
                    model=NAME,
                    prompt=[1, 4, 6],
                    max_tokens=150,
                    extra_body={"ignore_eos": True, "return_token_ids": True},
                )
            )
            start = server.engine.stats["generated_tokens"]
            while server.engine.stats["generated_tokens"] < start + 10:
                await asyncio.sleep(0.005)
            await asyncio.to_thread(_update, server, headers, other_weights, v0 + 1)
            return await task

    try:
        out = asyncio.run(main())
    finally:
        _update(server, headers, model_dir, v0 + 2)
    choice = out.choices[0]
    versions = choice.model_extra["token_versions"]
    assert choice.finish_reason == "length" and len(choice.model_extra["token_ids"]) == 150
    assert versions == sorted(versions) and {v0, v0 + 1} <= set(versions)


def _update(server, headers, folder, version):
    for path, body in (
        ("/pause_generation", {"mode": "abort"}),
        ("/update_weights_from_disk", {"model_path": str(folder), "weight_version": version}),
        ("/continue_generation", {}),
    ):
        resp = httpx.post(server.address + path, json=body, headers=headers, timeout=60)
        assert resp.status_code == 200, resp.text
