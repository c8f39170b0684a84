"""Hypothesis strategies for chat requests with the shapes real clients send."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

_WORDS = st.sampled_from(
    ["the", "answer", "is", "42", "def", "foo()", "x", "=", "1", "<pre>", "</pre>", "`code`", "`", "```",
     "~~~", "```py", "    ", "\t", "  ", " ", "\n", "\n\n", "\n\n\n", "\r\n", "hello", "world", "-", "#"]
)
TEXT = st.lists(_WORDS, max_size=40).map("".join)
# Repetition is what the lossless passes feed on.
REPEATED = st.builds(lambda line, n: (line + "\n") * n, TEXT, st.integers(1, 6))
ANY_TEXT = st.one_of(TEXT, REPEATED, st.builds(lambda a, b: a + "\n\n" + b + "\n\n" + a, TEXT, TEXT))


def _content(draw: Any) -> Any:
    kind = draw(st.sampled_from(["str", "str", "str", "parts"]))
    if kind == "str":
        return draw(ANY_TEXT)
    parts = draw(st.lists(
        st.one_of(
            ANY_TEXT.map(lambda t: {"type": "text", "text": t}),
            st.just({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}),
        ),
        min_size=1, max_size=3,
    ))
    return parts


@st.composite
def chat_requests(draw: Any) -> dict[str, Any]:
    """A chat request: optional system prompt(s), user/assistant turns, tool loops, duplicates."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(ANY_TEXT)})
    calls = 0
    for _ in range(draw(st.integers(1, 7))):
        messages.append({"role": "user", "content": _content(draw)})
        if draw(st.integers(0, 4)) == 0:
            messages.append(dict(messages[-1]))  # a client retry
        if draw(st.integers(0, 3)) == 0:
            calls += 1
            cid = f"call_{calls}"
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": cid, "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
            messages.append({"role": "tool", "tool_call_id": cid, "content": draw(ANY_TEXT)})
        if draw(st.integers(0, 5)) == 0 and messages[0]["role"] == "system":
            messages.append(dict(messages[0]))  # an agent framework re-sending its system prompt
        if draw(st.booleans()):
            messages.append({"role": "assistant", "content": _content(draw)})
    if draw(st.integers(0, 3)) == 0:
        messages.append({"role": "user", "content": _content(draw)})
    return {"model": "m", "temperature": 0.2, "messages": messages}


@st.composite
def policies(draw: Any) -> dict[str, Any]:
    """Trim policy sections across the budgets and switches that matter."""
    return {
        "tool_output": {"enabled": draw(st.booleans()), "max_tokens": draw(st.sampled_from([64, 128, 2048])),
                        "head_tokens": 16, "tail_tokens": 16},
        "history": {"max_tokens": draw(st.sampled_from([None, 40, 120, 400])), "marker": draw(st.booleans())},
        "boilerplate": {"min_paragraph_chars": draw(st.sampled_from([5, 200]))},
        "pin": {"roles": draw(st.sampled_from([[], ["system"]]))},
    }
