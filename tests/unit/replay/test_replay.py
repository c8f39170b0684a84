"""Replays through a real gateway: what the report counts, measures and fetches from /v1/usage."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import main
from gateway.replay.driver import parse_lane
from gateway.replay.run import replay
from gateway.replay.workload import read_lines
from tests.conftest import GatewayFactory
from tests.support.background import BackgroundLoop, RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, fault_app


def _workload(n: int, spacing: float = 0.0) -> list[str]:
    return [
        json.dumps({"at": i * spacing, "kind": "simple" if i % 2 else "hard",
                    "body": {"model": "fake-model", "messages": [{"role": "user", "content": f"question {i}"}],
                             "max_tokens": 8}})
        for i in range(n)
    ]


def test_lane_header_parsing() -> None:
    assert parse_lane("upstream:standard; score=0.410; reason=router") == ("upstream", "standard", "router")
    assert parse_lane("edge") == ("edge", None, None)
    assert parse_lane(None) == ("unknown", None, None)


def test_streamed_replay_reports_lane_tokens_ttft_and_ledger_cost(gateway: RunningApp, upstream: Any) -> None:
    _, rec = upstream
    items = read_lines(_workload(12, spacing=0.01))
    report = asyncio.run(replay(items, gateway.url + "/v1", concurrency=4, show_progress=False))
    assert rec.hits == 12
    assert all(body["stream"] for body in rec.bodies)
    lane = report["lanes"]["upstream"]
    assert lane["requests"] == 12 and lane["errors"] == 0
    assert lane["input_tokens"] == 12 * 7 and lane["output_tokens"] == 12 * 3
    assert lane["ttft_ms"]["n"] == 12
    assert lane["ttft_ms"]["p50"] <= lane["latency_ms"]["p50"]
    assert report["totals"]["cache_hit_rate"] is None  # this gateway runs without a cache
    assert report["totals"]["upstream_tokens_avoided"]["total"] == 0
    assert report["kinds"]["simple"]["requests"] == 6
    cost = report["cost"]
    assert cost["source"] == "GET /v1/usage"
    assert cost["total"]["requests"] == 12
    assert set(cost["by_lane"]) == {"upstream"}


def test_whole_answers_have_no_ttft(gateway: RunningApp, upstream: Any) -> None:
    _, rec = upstream
    report = asyncio.run(replay(read_lines(_workload(3)), gateway.url, concurrency=1, stream=False, show_progress=False))
    assert not any(body.get("stream") for body in rec.bodies)
    assert report["lanes"]["upstream"]["ttft_ms"]["n"] == 0
    assert report["lanes"]["upstream"]["output_tokens"] == 9


def test_failures_are_counted_with_their_status(make_gateway: GatewayFactory, bg: BackgroundLoop) -> None:
    rec = Recorder()
    broken = RunningApp(bg, fault_app("status", rec, status=500))
    try:
        gw = make_gateway(upstreams=[upstream_cfg("up", broken.url + "/v1", retries=0)])
        report = asyncio.run(replay(read_lines(_workload(4)), gw.url, concurrency=2, show_progress=False))
    finally:
        broken.stop()
    assert report["totals"]["errors"] == 4 and report["totals"]["ok"] == 0
    assert report["errors"]["by_status"] == {"502": 4}
    assert report["cost"]["by_lane"]["upstream"]["errors"] == 4


def test_cli_writes_json_and_png(gateway: RunningApp, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wl = tmp_path / "wl.jsonl"
    wl.write_text("\n".join(_workload(5)) + "\n")
    out = tmp_path / "out"
    rc = main(["replay", str(wl), "--url", gateway.url, "--concurrency", "2", "--out", str(out), "--api-key", "k"])
    assert rc == 0
    report = json.loads((out / "replay.json").read_text())
    assert report["totals"]["ok"] == 5 and report["workload"] == str(wl)
    assert (out / "replay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "upstream" in capsys.readouterr().out


def test_cli_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"at": 0, "body": {"messages": []}}\n{oops\n')
    assert main(["replay", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(_workload(1)) + "\n")
    assert main(["replay", str(good), "--url", "localhost:1"]) == 2
    with pytest.raises(SystemExit):
        main(["replay", str(good), "--concurrency", "0"])


def test_cli_fails_when_nothing_answers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.support.llama_server import free_port

    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(_workload(2)) + "\n")
    rc = main(["replay", str(good), "--url", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path / "o")])
    assert rc == 1
    assert "no request succeeded" in capsys.readouterr().err
    assert not (tmp_path / "o" / "replay.json").exists()


@pytest.mark.parametrize("stream", [False, True])
def test_checkable_lines_report_accuracy_beside_each_lane(gateway: RunningApp, upstream: Any, stream: bool) -> None:
    """The upstream answers "forty two is the answer": right for one line, wrong for the other."""
    lines = [
        json.dumps({"kind": "quiz", "check": "mention", "expected": "forty two",
                    "body": {"model": "fake-model", "messages": [{"role": "user", "content": "What is 6 x 7 in words?"}]}}),
        json.dumps({"kind": "quiz", "check": "mention", "expected": {"answer": "Paris", "aliases": ["paris, france"]},
                    "body": {"model": "fake-model", "messages": [{"role": "user", "content": "Capital of France?"}]}}),
        json.dumps({"kind": "chat", "body": {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}}),
    ]
    report = asyncio.run(replay(read_lines(lines), gateway.url, concurrency=1, stream=stream, show_progress=False))
    quality = report["quality"]
    assert quality["overall"] == {"checked": 2, "correct": 1, "accuracy": 0.5}
    assert quality["upstream"] == quality["overall"]
    assert quality["local"] == {"checked": 0, "correct": 0, "accuracy": None}
    assert report["lanes"]["upstream"]["accuracy"] == 0.5 and report["lanes"]["upstream"]["share"] == 1.0
    assert report["kinds"]["chat"]["checked"] == 0


@pytest.mark.parametrize(("line", "message"), [
    ({"check": "nope", "expected": "x"}, "unknown checker"),
    ({"check": "mention"}, "`expected` must be"),
    ({"check": "mention", "expected": {"answer": 3}}, "`expected` must be"),
    ({"check": "mention", "expected": {"answer": "a", "typo": 1}}, "`expected` must be"),
])
def test_checkable_lines_are_validated_when_read(line: dict[str, Any], message: str) -> None:
    from gateway.replay.workload import WorkloadError

    raw = json.dumps({**line, "body": {"messages": [{"role": "user", "content": "q"}]}})
    with pytest.raises(WorkloadError, match=message):
        read_lines([raw])


def test_edge_attempts_count_kept_and_escalated_answers_after_the_first_requests() -> None:
    from gateway.replay.driver import RequestResult
    from gateway.replay.report import edge_attempts

    def result(index: int, lane: str, *, escalated: bool = False, correct: bool | None = None) -> RequestResult:
        return RequestResult(index=index, kind=None, status=200, lane=lane, started_at=0.0, latency_s=1.0,
                             ttft_s=0.9 if escalated else 0.1, escalated=escalated, correct=correct)

    results = [result(0, "upstream", escalated=True), result(1, "edge", correct=True), result(2, "upstream"),
               result(3, "upstream", escalated=True), result(4, "edge", correct=False), result(5, "cache")]
    report = edge_attempts(results, after=2)
    assert report["all"] == {"attempts": 4, "kept": 2, "escalated": 2, "escalated_share": 0.5,
                             "kept_accuracy": {"checked": 2, "correct": 1, "accuracy": 0.5}}
    assert (report["after_first"]["attempts"], report["after_first"]["escalated_share"]) == (2, 0.5)
    ttft = report["upstream_ttft_ms"]  # upstream answers only: escalated ones beside those that tried nothing
    assert (ttft["escalated"]["n"], ttft["escalated"]["p50"], ttft["not_escalated"]["n"], ttft["not_escalated"]["p50"]) == (2, 900.0, 1, 100.0)
    assert edge_attempts([result(0, "upstream")])["all"]["escalated_share"] is None  # nothing tried
