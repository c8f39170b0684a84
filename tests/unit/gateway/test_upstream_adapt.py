"""Per-upstream body adaptation: the output limit a small context needs, one system message first."""

from __future__ import annotations

from gateway.settings import UpstreamSettings
from gateway.upstream.adapt import adapt, adapts


def cfg(**kw: object) -> UpstreamSettings:
    return UpstreamSettings(name="u", base_url="http://127.0.0.1:9/v1", **kw)  # type: ignore[arg-type]


MESSAGES = [{"role": "system", "content": "A."}, {"role": "user", "content": "Hi."},
            {"role": "system", "content": [{"type": "text", "text": "B."}]}, {"role": "assistant", "content": "Yo."}]


def test_an_upstream_that_declares_nothing_gets_the_body_as_it_is():
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 128000}
    assert not adapts(cfg()) and adapt(body, cfg(), "/chat/completions") is body


def test_the_output_limit_is_clamped_or_set():
    limited = cfg(max_output_tokens=64)
    assert adapts(limited)
    assert adapt({"messages": [], "max_tokens": 128000}, limited, "/chat/completions")["max_tokens"] == 64
    assert adapt({"messages": [], "max_tokens": 10}, limited, "/chat/completions")["max_tokens"] == 10
    both = adapt({"messages": [], "max_tokens": 100, "max_completion_tokens": 30}, limited, "/chat/completions")
    assert (both["max_tokens"], both["max_completion_tokens"]) == (64, 30)
    assert adapt({"messages": []}, limited, "/chat/completions")["max_tokens"] == 64
    assert "max_tokens" not in adapt({"input": "x"}, limited, "/embeddings")


def test_system_messages_first_merges_them_in_order():
    body = {"model": "m", "messages": MESSAGES}
    out = adapt(body, cfg(system_messages="first"), "/chat/completions")
    assert out["messages"] == [{"role": "system", "content": "A.\n\nB."}, {"role": "user", "content": "Hi."},
                               {"role": "assistant", "content": "Yo."}]
    assert body["messages"] is MESSAGES and len(MESSAGES) == 4  # the pipeline's body is never changed
    one = {"messages": MESSAGES[:2]}
    assert adapt(one, cfg(system_messages="first"), "/chat/completions") is one
