"""`tierlane router score`: JSON lines in, scores out, clear failures on bad input."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from gateway.cli import main
from gateway.pipeline.embed import embedding_text
from policies.embedding.embedder import encode
from policies.router import Router
from policies.router.cli import parse_score_line, score_stream


def test_score_round_trip(shipped_router: Router, sentence_model, monkeypatch, capsys) -> None:
    rows = [{"prompt": "hello there"}, {"messages": [{"role": "system", "content": "s"},
                                                     {"role": "user", "content": "Integrate x^2 sin x dx"}]}]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(json.dumps(r) for r in rows) + "\n\n"))
    assert main(["router", "score"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(out) == 2 and all(0.0 <= o["score"] <= 1.0 for o in out)
    emb = encode(sentence_model, ["hello there", "Integrate x^2 sin x dx"])
    expected = [shipped_router.score("hello there", emb[0]), shipped_router.score(rows[1]["messages"], emb[1])]
    np.testing.assert_allclose([o["score"] for o in out], expected, atol=1e-5)


def test_score_embeds_the_text_the_gateway_embeds(shipped_router: Router) -> None:
    seen: list[str] = []

    def embed(texts: list[str]) -> np.ndarray:
        seen.extend(texts)
        v = np.ones((len(texts), shipped_router.dimension), dtype=np.float32)
        return v / np.linalg.norm(v[0])

    chat = {"messages": [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
                         {"role": "user", "content": "  Ｓecond\n\nturn  " + "x" * 5000}]}
    out = io.StringIO()
    score_stream([json.dumps(chat)], out, shipped_router, embed)
    assert seen == [embedding_text(chat)]  # normalised last user turn, cut at 4000 chars
    vec = embed(["x"])[0]
    assert json.loads(out.getvalue())["score"] == round(shipped_router.score(chat["messages"], vec), 6)


def test_bad_line_fails_with_its_number(monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO('{"prompt": "ok"}\n{"text": "no"}\n'))
    assert main(["router", "score"]) == 2
    assert "line 2" in capsys.readouterr().err


@pytest.mark.parametrize("line", ["not json", "[1]", '{"messages": []}', '{"messages": [{"content": "x"}]}'])
def test_parse_rejects(line: str) -> None:
    with pytest.raises(ValueError, match="line 7"):
        parse_score_line(line, 7)


def test_score_stream_batches(shipped_router: Router) -> None:
    calls: list[int] = []

    def embed(texts: list[str]) -> np.ndarray:
        calls.append(len(texts))
        v = np.ones((len(texts), shipped_router.dimension), dtype=np.float32)
        return v / np.linalg.norm(v[0])

    out = io.StringIO()
    assert score_stream([json.dumps({"prompt": f"q{i}"}) for i in range(5)], out, shipped_router, embed, batch=2) == 5
    assert calls == [2, 2, 1] and len(out.getvalue().splitlines()) == 5


def test_eval_without_data_is_a_clear_error(tmp_path, capsys) -> None:
    assert main(["router", "eval", "--data", str(tmp_path)]) == 2
    assert "no router data" in capsys.readouterr().err
