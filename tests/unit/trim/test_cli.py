"""`tierlane trim` through the real command-line entry point."""

from __future__ import annotations

import io
import json
import sys
from typing import Any

import pytest

from gateway.cli import main


def _run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], stdin: bytes, *args: str) -> tuple[int, Any, str]:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    rc = main(["trim", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_prints_trimmed_request_and_report(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    req = {"model": "m", "messages": [
        {"role": "system", "content": "Be   brief."}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"}]}
    rc, out, err = _run(monkeypatch, capsys, json.dumps(req).encode())
    assert rc == 0
    assert json.loads(out)["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert "whitespace" in err and "duplicates" in err and "dropped messages[1]" in err
    assert "(estimated)" not in err  # counted with the edge tokenizer


def test_json_report_with_budget(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    msgs = [{"role": "user", "content": "first"}]
    for i in range(20):
        msgs += [{"role": "assistant", "content": f"reply {i} " * 20}, {"role": "user", "content": f"q{i}"}]
    rc, out, err = _run(monkeypatch, capsys, json.dumps({"messages": msgs}).encode(),
                        "--budget", "150", "--tokenizer", "estimate", "--json-report")
    report = json.loads(err)
    assert rc == 0 and report["estimated"] is True
    assert report["saved_by_pass"]["history"] > 0 and report["output_tokens"] <= 150
    assert len(json.loads(out)["messages"]) == len(msgs) - len(report["dropped"])


@pytest.mark.parametrize(
    ("stdin", "needle"),
    [(b"{not json", "not valid JSON"), (b'{"messages": [{"role": "bot"}]}', "messages[0].role"), (b"[]", "JSON object")],
)
def test_bad_input_exits_2_with_a_message(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                          stdin: bytes, needle: str) -> None:
    rc, out, err = _run(monkeypatch, capsys, stdin, "--tokenizer", "estimate")
    assert rc == 2 and out == "" and needle in err
