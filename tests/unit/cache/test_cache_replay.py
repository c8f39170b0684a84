"""A cached answer replayed as SSE parses with the openai SDK's own decoder."""

from __future__ import annotations

import orjson
import pytest
from helpers import Flow, chat
from openai._streaming import SSEDecoder
from openai.types.chat import ChatCompletion, ChatCompletionChunk

pytestmark = pytest.mark.slow

ANSWER = "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. " * 3


async def _sse(chunks) -> bytes:
    frames = [b"data: " + orjson.dumps(c) + b"\n\n" async for c in chunks]
    return b"".join(frames) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("include_usage", [False, True])
async def test_stream_replay_is_a_valid_sse_stream(flow: Flow, include_usage: bool) -> None:
    await flow.answer(chat("What is photosynthesis?"), ANSWER)
    body = chat("What is photosynthesis?", stream=True, stream_options={"include_usage": include_usage})
    ctx, answer = await flow.ask(body)
    assert answer is not None and answer.chunks is not None and answer.body is None
    raw = await _sse(answer.chunks)
    events = list(SSEDecoder().iter_bytes(iter([raw])))
    assert events[-1].data == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(e.json()) for e in events[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ANSWER
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert len({c.id for c in chunks}) == 1
    usage = [c.usage for c in chunks if c.usage is not None]
    if include_usage:
        assert chunks[-1].choices == [] and usage and usage[-1].completion_tokens == 7
    else:
        assert not usage


async def test_json_replay_validates_as_a_chat_completion(flow: Flow) -> None:
    await flow.answer(chat("What is photosynthesis?"), ANSWER)
    _, answer = await flow.ask(chat("What is photosynthesis?"))
    assert answer is not None and answer.body is not None
    completion = ChatCompletion.model_validate(answer.body)
    assert completion.choices[0].message.content == ANSWER
    assert completion.usage is not None and completion.usage.total_tokens == 19
