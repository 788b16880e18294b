"""A session's streamed chat completion: text deltas as the inference server generates them.

The generation streams from the server (``InferenceClient.agenerate`` with ``on_tokens``); each
batch of new tokens becomes a ``chat.completion.chunk`` with the text they add, held back while
it could be the start of a stop string or ends inside a character. The completion is recorded
exactly as an unstreamed one (the record comes from the server's whole result), under the id the
chunks carry. Ending the session cancels the generation: the stream then ends with an error
event (status 409), as OpenAI streams report errors after the headers went out.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from tidal.extras import needs_extra

with needs_extra("llm", "the session proxy"):
    from fastapi.responses import StreamingResponse

from tidal.inference.agent_client import ChatCall
from tidal.inference.openai_response import server_sent_event, usage
from tidal.inference.protocol import error_event


class TextDeltas:
    """The new text of a growing completion, decoded from all its tokens so far."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.hold = max((len(s) for s in stop), default=0)
        self.ids: list[int] = []
        self.sent = 0  # characters passed on

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        safe = len(text) - self.hold
        while safe > self.sent and text[safe - 1] == "\ufffd":  # a character's bytes still due
            safe -= 1
        if safe <= self.sent:
            return ""
        piece, self.sent = text[self.sent : safe], safe
        return piece

    def rest(self, final: str) -> str:
        """What the final text (stop string cut) adds to what was passed on."""
        return final[self.sent :]


def chat_stream(session, call: ChatCall, include_usage: bool, model: str) -> StreamingResponse:
    """Server-sent events of ``call`` generated and recorded on ``session``: a role chunk, a
    chunk per batch of new text, one with the finish reason, the usage when asked, ``[DONE]``."""
    client = session.client
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    head = {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time())}
    head["model"] = model

    def chunk(delta: dict, finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return server_sent_event({**head, "choices": [choice]})

    async def events():
        queue: asyncio.Queue = asyncio.Queue()
        deltas = TextDeltas(client.tokenizer, call.cfg.stop)
        task = asyncio.ensure_future(
            client.record(
                call.prompt, call.cfg, call.messages, call.tools, queue.put_nowait, completion_id
            )
        )
        task.add_done_callback(lambda _: queue.put_nowait(None))
        session.calls.add(task)  # ending the session cancels it
        try:
            yield chunk({"role": "assistant", "content": ""})
            while (ids := await queue.get()) is not None:
                if piece := deltas.add(ids):
                    yield chunk({"content": piece})
            try:
                record = task.result()
            except asyncio.CancelledError:
                yield error_event(409, f"session {session.id} ended during the call")
                return
            except Exception as exc:  # the server failed: reported in the stream, as OpenAI does
                yield error_event(500, f"{type(exc).__name__}: {exc}")
                return
            if rest := deltas.rest(record.content):
                yield chunk({"content": rest})
            yield chunk({}, record.finish_reason)
            if include_usage:
                counts = usage(len(record.prompt_ids), len(record.output_ids))
                yield server_sent_event({**head, "choices": [], "usage": counts})
            yield "data: [DONE]\n\n"
        finally:
            session.calls.discard(task)
            task.cancel()  # the client went away: its generation is not wanted

    return StreamingResponse(events(), media_type="text/event-stream")
