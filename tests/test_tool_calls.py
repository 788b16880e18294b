"""Tool calls: the Hermes/Qwen parser, tidal's OpenAI API with ``tools`` (the official client),
and the in-process recording client in a multi-turn tool loop."""

import asyncio
import json
import re

import pytest
from agent_models import ADD_TOOL, QUESTION, tool_loop
from deps import require
from transformers import AutoTokenizer

from tidal.inference import GenerationConfig, GenerationEngine, InferenceClient, InferenceServer
from tidal.inference.client import ModelResponse
from tidal.inference.tool_calls import (
    TOOL_PARSERS,
    ParsedOutput,
    check_tools,
    hermes_tool_calls,
    parse_tool_calls,
)
from tidal.models.chat_template import render_chat

openai = require("openai")
from tidal.inference.agent_client import RecordingOpenAI  # noqa: E402
from tidal.rollout.agent_workflow import AgentWorkflow  # noqa: E402


def test_hermes_parses_calls_and_keeps_a_malformed_one_as_content():
    text = 'let me add<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "neg", "arguments": "{\\"x\\": 2}"}</tool_call>'
    out = hermes_tool_calls(text)
    assert out.content == "let me add" and out.error is None and out.finish_reason == "tool_calls"
    assert [c["function"]["name"] for c in out.tool_calls] == ["add", "neg"]
    assert [json.loads(c["function"]["arguments"]) for c in out.tool_calls] == [{"a": 1}, {"x": 2}]
    assert len({c["id"] for c in out.tool_calls}) == 2
    for bad, why in (
        ("<tool_call>{not json}</tool_call>", "not JSON"),
        ('<tool_call>{"name": "add"', "not closed"),
        ('<tool_call>{"arguments": {}}</tool_call>', "name"),
        ('<tool_call>{"name": "f", "arguments": 3}</tool_call>', "arguments"),
    ):
        out = hermes_tool_calls(bad)
        assert out.content == bad and out.tool_calls == [] and why in out.error
    assert hermes_tool_calls("plain").message() == {"role": "assistant", "content": "plain"}
    assert TOOL_PARSERS.get("qwen") is hermes_tool_calls
    with pytest.raises(ValueError, match="rollout.tool_parser: unknown tool parser 'x'"):
        TOOL_PARSERS.get("x")
    assert check_tools([ADD_TOOL], "none") is None
    with pytest.raises(ValueError, match="tool_choice"):
        check_tools([ADD_TOOL], {"type": "function", "function": {"name": "mul"}})
    with pytest.raises(ValueError, match="tools"):
        check_tools([{"type": "function"}], "auto")


def test_tool_messages_and_calls_render_through_the_template(tool_model):
    tok = AutoTokenizer.from_pretrained(tool_model)
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    text = render_chat(messages, tok, tools=[ADD_TOOL])
    assert '<tools>{"name": "add"' in text
    assert '<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>' in text
    assert text.endswith("<tool_response>3</tool_response><|im_end|>\n<|im_start|>assistant\n")


# SmolLM2-135M-Instruct's own template (its GGUF's): ChatML with no tool syntax
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_template_without_tool_syntax_gets_tools_and_calls_written_the_hermes_way():
    """Such a template drops tools and tool calls silently: tidal writes them into the messages
    (the tools in a system turn, calls as <tool_call>, results as <tool_response> user turns)
    and the hermes parser reads a call written so back as it was."""
    from tidal.inference.tiny import CHATML_TEMPLATE, TOOLS_CHATML_TEMPLATE, byte_level_tokenizer
    from tidal.models.chat_template import knows_tools

    assert not knows_tools(SMOLLM2_TEMPLATE) and not knows_tools(CHATML_TEMPLATE)
    assert knows_tools(TOOLS_CHATML_TEMPLATE)
    tok = byte_level_tokenizer(chat_template=SMOLLM2_TEMPLATE)
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3}'}}
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "let me add", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    text = render_chat(messages, tok, tools=[ADD_TOOL])
    system, user, assistant, result, prompt = text.split("<|im_start|>")[1:]
    assert system.startswith("system\nYou are a function calling AI model")  # no default turn
    assert json.dumps(ADD_TOOL["function"]) in system and "<tool_call>" in system
    assert user == "user\nq<|im_end|>\n"
    written = assistant.removeprefix("assistant\n").removesuffix("<|im_end|>\n")
    assert (
        written == 'let me add\n<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>'
    )
    parsed = parse_tool_calls(written, "hermes", [ADD_TOOL])
    assert parsed.content == "let me add" and parsed.error is None
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls
    ] == [("add", {"a": 3})]
    assert result == "user\n<tool_response>\n3\n</tool_response><|im_end|>\n"
    assert prompt == "assistant\n"
    # a system turn of the conversation's own keeps its text, the tools after it
    own = render_chat(
        [{"role": "system", "content": "Be brief."}, *messages[:1]], tok, tools=[ADD_TOOL]
    )
    assert own.startswith("<|im_start|>system\nBe brief.\n\nYou are a function calling")
    # without tools or calls the messages render as the template writes them
    assert render_chat(messages[:1], tok).startswith("<|im_start|>system\nYou are a helpful AI")


@pytest.fixture(scope="module")
def server(tool_model):
    srv = InferenceServer(GenerationEngine(tool_model)).start()
    yield srv
    srv.stop()


def test_the_openai_api_returns_tool_calls_and_reads_tool_results(server):
    with openai.OpenAI(base_url=server.address + "/v1", api_key="x", max_retries=0) as client:
        name = client.models.list().data[0].id
        messages = [{"role": "user", "content": QUESTION}]
        first = client.chat.completions.create(
            model=name, messages=messages, tools=[ADD_TOOL], temperature=0, max_tokens=40
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        (call,) = choice.message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == {
            "a": 3,
            "b": 4,
        }
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "7"},
        ]
        second = client.chat.completions.create(
            model=name, messages=messages, tools=[ADD_TOOL], temperature=0, max_tokens=8
        )
        assert second.choices[0].message.content == "7"
        assert second.choices[0].finish_reason == "stop"
        chunks = list(
            client.chat.completions.create(
                model=name,
                messages=messages[:1],
                tools=[ADD_TOOL],
                temperature=0,
                max_tokens=40,
                stream=True,
            )
        )
        streamed = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        assert [d.function.name for d in streamed] == ["add"]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # tool_choice none: no tools rendered, nothing parsed
        plain = client.chat.completions.create(
            model=name,
            messages=messages[:1],
            tools=[ADD_TOOL],
            tool_choice="none",
            temperature=0,
            max_tokens=40,
        )
        assert plain.choices[0].message.tool_calls is None


class ScriptedInference:
    """An InferenceClient whose answers are fixed texts (to test what the client does with
    them)."""

    def __init__(self, tok, texts):
        self.tok, self.texts = tok, list(texts)

    async def agenerate(self, req):
        ids = self.tok(self.texts.pop(0), add_special_tokens=False).input_ids
        return ModelResponse(list(req.input_ids), ids, [-1.0] * len(ids), [0] * len(ids))


def test_a_malformed_tool_call_is_content_with_stop_and_counted(tool_model):
    tok = AutoTokenizer.from_pretrained(tool_model)
    bad = '<tool_call>{"name": add}</tool_call>'

    async def main():
        client = RecordingOpenAI(ScriptedInference(tok, [bad]), tok)
        out = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "q"}], tools=[ADD_TOOL]
        )
        return out, client.tool_parse_errors

    out, errors = asyncio.run(main())
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.content == bad
    assert out.choices[0].message.tool_calls is None and errors == 1


async def tool_agent(client, data):
    """A plain OpenAI-SDK tool loop: call the model, run its tool calls, until it answers."""
    return float(await tool_loop(client, data["question"]) == data["answer"])


def test_an_in_process_agent_uses_tools_and_trains_on_one_sequence(server, tool_model):
    tok = AutoTokenizer.from_pretrained(tool_model)
    gconfig = GenerationConfig(
        max_new_tokens=40, temperature=1e-6, stop_token_ids=[tok.eos_token_id]
    )

    async def main():
        inference = InferenceClient([server.address])
        try:
            flow = AgentWorkflow(tool_agent, inference, tok, gconfig, mode="concat")
            return await flow({"question": QUESTION, "answer": "7"}), flow.metrics()
        finally:
            await inference.aclose()

    episode, metrics = asyncio.run(main())
    assert metrics == {"rollout/tool_parse_errors": 0}
    assert episode.rewards.tolist() == [1.0] and episode.input_ids.shape[0] == 1
    n = int(episode.attention_mask[0].sum())
    ids, mask = episode.input_ids[0, :n], episode.loss_mask[0, :n]
    trained = tok.decode(ids[mask])
    assert (
        trained
        == '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call><|im_end|>7<|im_end|>'
    )
    assert "<tool_response>7</tool_response>" in tok.decode(ids[~mask])


def test_an_in_process_agent_parses_tool_calls_with_rollout_tool_parser(tool_model, monkeypatch):
    """The configured parser (here a registered one of a format of its own, ``name(a, b)``),
    not Hermes, turns the model's text into the agent's tool calls."""
    from tidal.config.llm import LLMConfig
    from tidal.config.loader import load_config
    from tidal.rollout.workflows import WorkflowContext
    from tidal.runners.llm.workflows import in_process_agent

    parsed = []

    def calls(text: str) -> ParsedOutput:
        parsed.append(text)
        found = re.fullmatch(r"(\w+)\((\d+), (\d+)\)", text)
        if found is None:
            return ParsedOutput(text)
        args = json.dumps({"a": int(found[2]), "b": int(found[3])})
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": found[1], "arguments": args},
        }
        return ParsedOutput(None, [call])

    monkeypatch.setitem(TOOL_PARSERS._items, "calls", calls)  # registered for this test only
    tok = AutoTokenizer.from_pretrained(tool_model)
    cfg = load_config(LLMConfig, None, ["rollout.tool_parser=calls", "rollout.group_size=1"])
    ctx = WorkflowContext(
        cfg=cfg,
        client=ScriptedInference(tok, ["add(3, 4)<|im_end|>", "7<|im_end|>"]),
        tokenizer=tok,
        gconfig=GenerationConfig(max_new_tokens=40, stop_token_ids=[tok.eos_token_id]),
        train_data=None,
    )
    flow = in_process_agent(ctx, tool_agent)
    episode = asyncio.run(flow({"question": QUESTION, "answer": "7"}))
    assert parsed == ["add(3, 4)", "7"]  # both answers, by the configured parser
    assert episode.rewards.tolist() == [1.0]  # the agent ran the call and answered its result
    assert flow.metrics() == {"rollout/tool_parse_errors": 0}
    with pytest.raises(ValueError, match="rollout.tool_parser: unknown tool parser 'nope'"):
        AgentWorkflow(tool_agent, ctx.client, tok, ctx.gconfig, tool_parser="nope")


def test_tidal_serve_refuses_an_unknown_tool_parser_by_its_flag(tmp_path, capsys):
    from tidal.cli import main

    assert main(["serve", "--model", str(tmp_path), "--tool-parser", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--tool-parser" in err and "'nope'" in err and "hermes" in err


def test_a_tool_call_demonstration_is_token_for_token_the_agent_episode(tool_model):
    """What ``tidal sft`` learns from a tool-call conversation is exactly the sequence the
    session records when the model replays it: the same context between the turns (the
    template's newline after EOS included) and the same learned tokens."""
    from tidal.models.llm import sft_tokens
    from tidal.rollout.agent_workflow import episode_sequences

    tok = AutoTokenizer.from_pretrained(tool_model)
    args = json.dumps({"a": 3, "b": 4})
    call = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": args}}
    demo = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "7"},
        {"role": "assistant", "content": "7"},
    ]
    ids, mask = sft_tokens(tok, demo, tools=[ADD_TOOL])
    replies = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call><|im_end|>'

    async def main():
        client = RecordingOpenAI(ScriptedInference(tok, [replies, "7<|im_end|>"]), tok)
        messages = demo[:1]
        first = await client.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL])
        messages = [*messages, first.choices[0].message.model_dump(exclude_none=True), demo[2]]
        await client.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL])
        return client.completions_made

    (seq,), _ = episode_sequences(asyncio.run(main()), 1.0, "concat", 1.0)
    n = len(seq.tokens)  # the demonstration goes on with the template's untrained newline
    assert tok.decode(seq.tokens) == tok.decode(ids[:n]) and not any(mask[n:])
    assert seq.tokens == ids[:n] and [int(m) for m in seq.loss_mask] == mask[:n]
