"""The Batch API through the real app and the official SDKs, before a recording upstream.

Each line runs through the pipeline (one ledger row, at the batch discount); identical lines are
answered once; a restart mid-job loses and doubles no line; tenants never see each other's files
or jobs; bad files are refused in each API's own error shape; an expired window ends a job with
what is done.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
import yaml
from aiohttp import web

from gateway.auth import hash_key
from gateway.batches.service import BATCHES
from gateway.keys import SERVICES
from policies.policy import _deep_merge
from tests.conftest import REPO
from tests.support.background import RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.faults import Recorder, completion, fault_app

ANSWER = "Batch answers arrive"
KEY_A, KEY_B = "tl-batches-tenant-a", "tl-batches-tenant-b"


def wait_for(check: Callable[[], Any], what: str, within: float = 60.0) -> Any:
    """Poll `check` until it returns something true (a generous bound, never a timing assertion)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"never: {what}")


def chat_line(custom_id: str, question: str) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": question}], "max_tokens": 8, "temperature": 0}}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(line) + b"\n" for line in lines)


def sdk(gw: RunningApp, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def claude(gw: RunningApp, key: str = "x") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0)


def ledger_rows(gw: RunningApp, state: Path) -> list[tuple[str, float, int]]:
    """(request_id, cost, status) of every ledger row, once the hooks have written them."""
    httpx.get(gw.url + "/v1/usage", params={"group_by": "tenant"}, timeout=30)  # flushes the ledger
    conn = sqlite3.connect(state / "ledger.sqlite3")
    try:
        return conn.execute("SELECT request_id, cost, status FROM requests ORDER BY id").fetchall()
    finally:
        conn.close()


def batch_rows(gw: RunningApp, state: Path, expected: int) -> list[tuple[str, float, int]]:
    def rows() -> list[tuple[str, float, int]] | None:
        found = [row for row in ledger_rows(gw, state) if row[0].startswith("batch_req_")]
        return found if len(found) >= expected else None

    return wait_for(rows, f"{expected} batch rows in the ledger")


@pytest.fixture
def upstream(bg):
    rec = Recorder()
    held = {"on": False}
    up = RunningApp(bg, fault_app("ok", rec, text=ANSWER, hold_until=lambda: not held["on"]))
    return up, rec, held


@pytest.fixture
def gw(upstream, make_gateway):
    up, rec, held = upstream
    return make_gateway(upstreams=[upstream_cfg("up", up.url + "/v1", models=["m"])])


def test_an_openai_batch_runs_every_line_once_through_the_pipeline(gw, upstream, tmp_path):
    _, rec, _ = upstream
    client = sdk(gw)
    lines = [chat_line("a", "What is tea?"), chat_line("b", "What is coffee?"), chat_line("c", "What is tea?")]
    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    assert client.files.retrieve(uploaded.id).filename == "in.jsonl"
    assert client.files.content(uploaded.id).content == jsonl(lines)
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "nightly"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "nightly"}
    done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, "the batch completed")
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (3, 3, 0)
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.error_file_id is None
    assert done.output_file_id is not None
    output = [orjson.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(line["custom_id"] for line in output) == ["a", "b", "c"]
    for line in output:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200
        assert line["response"]["body"]["choices"][0]["message"]["content"] == ANSWER
    assert rec.hits == 2  # the two identical lines were answered once
    # one ledger row per pipeline run, at the batch discount: half what the same interactive request costs
    rows = batch_rows(gw, tmp_path / "state", 2)
    assert len(rows) == 2 and all(status == 200 for _, _, status in rows)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "What is tea?"}], max_tokens=8)
    interactive = wait_for(lambda: [r for r in ledger_rows(gw, tmp_path / "state") if not r[0].startswith("batch_req_")],
                           "the interactive row")
    assert rows[0][1] == pytest.approx(interactive[0][1] * 0.5)
    board = httpx.get(gw.url + "/v1/dashboard", timeout=30).json()["batches"]  # progress on the dashboard
    assert board["jobs"] == {"completed": 1} and board["lines"]["pending"] == 0
    listed = client.batches.list(limit=10)
    assert [b.id for b in listed.data] == [batch.id]
    assert uploaded.id in [f.id for f in client.files.list()]
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_responses_and_embeddings_lines_answer_in_their_apis_shape(gw):
    client = sdk(gw)
    bodies = {"/v1/responses": {"model": "m", "input": "Hi", "max_output_tokens": 8},
              "/v1/embeddings": {"model": "m", "input": "Hi"}}
    out = {}
    for url, body in bodies.items():
        uploaded = client.files.create(file=("in.jsonl", jsonl([{"custom_id": "x", "method": "POST", "url": url,
                                                                "body": body}])), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint=url, completion_window="24h")  # type: ignore[arg-type]
        done = wait_for(lambda batch_id=batch.id: (b := client.batches.retrieve(batch_id)).status == "completed" and b,
                        f"{url} completed")
        out[url] = orjson.loads(client.files.content(done.output_file_id or "").text)["response"]["body"]
    response = out["/v1/responses"]
    assert response["object"] == "response" and response["store"] is False  # its answer is the output file
    assert response["output"][0]["content"][0]["text"] == ANSWER
    assert out["/v1/embeddings"]["data"][0]["embedding"] == [0.1, 0.2, 0.3]


def test_a_batch_of_lines_for_another_endpoint_fails_naming_them(gw):
    client = sdk(gw)
    uploaded = client.files.create(file=("in.jsonl", jsonl([chat_line("a", "Hi?")])), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    failed = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status == "failed" and b, "the batch failed")
    assert failed.errors is not None and failed.errors.data is not None
    assert failed.errors.data[0].line == 1 and "/v1/chat/completions" in (failed.errors.data[0].message or "")
    assert failed.failed_at is not None and failed.output_file_id is None


def test_an_anthropic_batch_gives_its_results_in_order(gw, upstream):
    client = claude(gw)
    params = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello"}]}
    created = client.messages.batches.create(requests=[
        {"custom_id": "first", "params": params},
        {"custom_id": "second", "params": {**params, "model": "no-such-model"}},  # answered as an error
    ])
    assert created.type == "message_batch" and created.processing_status == "in_progress"
    ended = wait_for(lambda: (b := client.messages.batches.retrieve(created.id)).processing_status == "ended" and b,
                     "the message batch ended")
    counts = ended.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == (0, 1, 1, 0, 0)
    assert ended.results_url and ended.ended_at is not None
    results = list(client.messages.batches.results(created.id))
    assert [r.custom_id for r in results] == ["first", "second"]
    assert results[0].result.type == "succeeded" and results[0].result.message.content[0].text == ANSWER
    assert results[1].result.type == "errored" and results[1].result.error.error.type == "not_found_error"
    assert [b.id for b in client.messages.batches.list()] == [created.id]
    assert client.messages.batches.delete(created.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.batches.retrieve(created.id)
    assert err.value.body["type"] == "error"


def test_cancel_finishes_the_lines_in_flight_and_cancels_the_rest(gw, upstream):
    _, rec, held = upstream
    held["on"] = True
    client = sdk(gw)
    uploaded = client.files.create(file=("in.jsonl", jsonl([chat_line(f"n{i}", f"Question {i}?") for i in range(6)])),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: rec.inflight == 2, "two lines in flight")  # batches.concurrency: 2
    assert client.batches.cancel(batch.id).status == "cancelling"
    held["on"] = False
    done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status == "cancelled" and b, "the batch cancelled")
    counts = done.request_counts
    assert counts is not None and counts.completed >= 2 and counts.completed + counts.failed == 6
    assert rec.hits == counts.completed  # no line ran after the cancel but those in flight
    errors = [orjson.loads(line) for line in client.files.content(done.error_file_id or "").text.splitlines()]
    assert len(errors) == counts.failed and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert all(e["response"] is None for e in errors)


def test_a_restart_mid_job_loses_and_doubles_no_line(bg, upstream, make_gateway, tmp_path):
    up, rec, held = upstream
    held["on"] = True
    first = make_gateway(upstreams=[upstream_cfg("up", up.url + "/v1", models=["m"], retries=0)])
    client = sdk(first)
    uploaded = client.files.create(file=("in.jsonl", jsonl([chat_line(f"n{i}", f"Question {i}?") for i in range(5)])),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: rec.inflight == 2, "two lines held by the upstream")
    first.stop()  # the two lines in flight are cut off: neither recorded nor metered
    held["on"] = False
    second = make_gateway(upstreams=[upstream_cfg("up", up.url + "/v1", models=["m"], retries=0)])
    client = sdk(second)
    done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, "the batch completed")
    assert done.request_counts is not None and done.request_counts.completed == 5
    output = [orjson.loads(line) for line in client.files.content(done.output_file_id or "").text.splitlines()]
    assert sorted(line["custom_id"] for line in output) == [f"n{i}" for i in range(5)]
    rows = batch_rows(second, tmp_path / "state", 5)
    assert len(rows) == 5 and len({request_id for request_id, _, _ in rows}) == 5  # one row per line
    assert {line["id"] for line in output} == {request_id for request_id, _, _ in rows}
    assert rec.hits == 7  # at least once to the upstream: the two cut off were asked again


def test_a_line_flow_control_refuses_waits_and_runs_again_instead_of_failing(bg, upstream, make_gateway):
    up, rec, held = upstream
    held["on"] = True
    # a member of budget 1 whose batch queue takes nobody: a batch line finding it busy is refused upstream_busy
    gw = make_gateway(upstreams=[upstream_cfg("up", up.url + "/v1", models=["m"], max_concurrency=1)],
                      pools={"default": {"flow": {"batch": {"max_queued": 0, "retry_after_s": 0.05}}}})
    person = httpx.Client(timeout=90)
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(person.post, gw.url + "/v1/chat/completions",
                           json={"model": "m", "messages": [{"role": "user", "content": "A person asks"}]})
        wait_for(lambda: rec.inflight == 1, "the person's request held by the upstream")
        client = sdk(gw)
        uploaded = client.files.create(file=("in.jsonl", jsonl([chat_line(f"n{i}", f"Question {i}?") for i in range(3)])),
                                       purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_for(lambda: refused(bg, gw) >= 2, "batch lines refused by flow control")
        assert rec.hits == 1 and client.batches.retrieve(batch.id).request_counts.failed == 0  # type: ignore[union-attr]
        held["on"] = False
        assert busy.result().status_code == 200
    done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, "the batch completed")
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 0) and done.error_file_id is None
    output = [orjson.loads(line) for line in client.files.content(done.output_file_id or "").text.splitlines()]
    assert sorted(line["custom_id"] for line in output) == ["n0", "n1", "n2"]
    assert all(line["response"]["status_code"] == 200 for line in output)


def refused(bg, gw: RunningApp) -> int:
    """Batch requests flow control answered upstream_busy, read on the gateway's loop."""

    async def read() -> int:
        classes, _ = gw.app[SERVICES].pool.flow_stats()
        return sum(sum(c.shed.values()) for c in classes if c.priority == "batch")

    return bg.call(read())


def held_upstream_app(held: dict[str, bool], asked: Counter[str]) -> web.Application:
    """An upstream that answers at once, but keeps a question naming "hold" while held["on"]."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        question = body["messages"][0]["content"]
        asked[question] += 1
        while "hold" in question and held["on"]:  # noqa: ASYNC110 - polls the test's state
            await asyncio.sleep(0.005)
        return web.json_response(completion(ANSWER, body.get("model", "m")))

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    return app


def serve_process(config: dict[str, Any], tmp_path: Path, name: str) -> tuple[subprocess.Popen[bytes], str]:
    """`tierlane serve` in a process of its own, once it answers /healthz."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    log = open(tmp_path / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port),
                             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()
        try:
            return httpx.get(url + "/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, f"the gateway process {name} answered /healthz", within=120)
    return proc, url


def test_a_gateway_killed_mid_job_and_started_again_loses_and_doubles_no_line(bg, tmp_path):
    held, asked = {"on": True}, Counter[str]()
    up = RunningApp(bg, held_upstream_app(held, asked))
    state = tmp_path / "state"
    config = _deep_merge(PASS_THROUGH, {"state_dir": str(state), "batches": {"concurrency": 2},
                                        "upstreams": [upstream_cfg("up", up.url + "/v1", models=["m"], retries=0)]})
    questions = [f"Question {i}?" for i in range(6)] + [f"Question {i}, hold?" for i in range(6, 12)]
    first, url = serve_process(config, tmp_path, "first")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        uploaded = client.files.create(file=("in.jsonl", jsonl([chat_line(f"n{i}", q) for i, q in enumerate(questions)])),
                                       purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        # six lines answered and recorded, two more held by the upstream when the process dies
        wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed == 6  # type: ignore[union-attr]
                 and sum(asked[q] for q in questions[6:]) == 2, "six lines recorded and two in flight")
        httpx.get(url + "/v1/usage", params={"group_by": "tenant"}, timeout=30)  # the ledger's commit window written
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    held["on"] = False
    second, url = serve_process(config, tmp_path, "second")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, "the batch completed")
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (12, 0)
        output = [orjson.loads(line) for line in client.files.content(done.output_file_id or "").text.splitlines()]
        assert sorted(line["custom_id"] for line in output) == sorted(f"n{i}" for i in range(12))  # each once
        httpx.get(url + "/v1/usage", params={"group_by": "tenant"}, timeout=30)  # flushes the ledger

        def rows() -> list[str] | None:
            conn = sqlite3.connect(state / "ledger.sqlite3")
            try:
                found = [r for (r,) in conn.execute("SELECT request_id FROM requests") if r.startswith("batch_req_")]
            finally:
                conn.close()
            return found if len(found) >= 12 else None

        metered = wait_for(rows, "12 batch rows in the ledger")
        assert len(metered) == 12 and set(metered) == {line["id"] for line in output}  # one row per line, none twice
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(30)
    # at least once to the upstream: the lines recorded before the kill were not asked again
    assert all(asked[q] == 1 for q in questions[:6]) and all(asked[q] >= 1 for q in questions[6:])
    assert sum(asked[q] for q in questions[6:]) == 6 + 2  # the two cut off by the kill were asked again


def test_tenants_never_see_each_others_files_or_jobs(upstream, make_gateway):
    up, _, _ = upstream
    keys = [{"sha256": hash_key(KEY_A), "tenant": "a"}, {"sha256": hash_key(KEY_B), "tenant": "b"}]
    gw = make_gateway(upstreams=[upstream_cfg("up", up.url + "/v1", models=["m"])], auth={"mode": "keys", "keys": keys})
    a, b = sdk(gw, KEY_A), sdk(gw, KEY_B)
    uploaded = a.files.create(file=("in.jsonl", jsonl([chat_line("x", "Hi?")])), purpose="batch")
    batch = a.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: b.files.retrieve(uploaded.id), lambda: b.files.content(uploaded.id),
                 lambda: b.files.delete(uploaded.id), lambda: b.batches.retrieve(batch.id),
                 lambda: b.batches.cancel(batch.id),
                 lambda: b.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert list(b.files.list()) == [] and list(b.batches.list()) == []
    assert uploaded.id in [f.id for f in a.files.list()]  # (with its batch's output file, once it has one)
    ca, cb = claude(gw, KEY_A), claude(gw, KEY_B)
    made = ca.messages.batches.create(requests=[{"custom_id": "x", "params": {
        "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}}])
    with pytest.raises(anthropic.NotFoundError):
        cb.messages.batches.retrieve(made.id)
    assert list(cb.messages.batches.list()) == []
    wait_for(lambda: a.batches.retrieve(batch.id).status == "completed", "tenant a's batch completed")


@pytest.mark.parametrize(("content", "says"), [
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\nnot json\n', "line 2 is not JSON"),
    (jsonl([{**chat_line("a", "Hi?"), "url": "/v1/images/generations"}]), "line 1: `url`"),
    (jsonl([chat_line("a", "Hi?"), chat_line("a", "Again?")]), "line 2: custom_id 'a' is already used"),
    (jsonl([{**chat_line("a", "Hi?"), "method": "GET"}]), "line 1: `method` must be POST"),
    (jsonl([chat_line(f"n{i}", "x" * 200) for i in range(20)]), "larger than 2048 bytes"),
])
def test_bad_files_are_refused_in_openais_error_shape(upstream, make_gateway, content, says):
    up, _, _ = upstream
    gw = make_gateway(upstreams=[upstream_cfg("up", up.url + "/v1", models=["m"])], batches={"max_file_bytes": 2048})
    with pytest.raises(openai.BadRequestError) as err:
        sdk(gw).files.create(file=("in.jsonl", content), purpose="batch")
    assert err.value.status_code == 400 and says in err.value.body["message"]  # type: ignore[index]
    assert err.value.body["type"] == "invalid_request_error"  # type: ignore[index]


def test_bad_message_batches_are_refused_in_anthropics_error_shape(gw):
    client = claude(gw)
    good = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    for requests, says in (([{"custom_id": "a", "params": {"model": "m"}}], "requests[0].params"),
                           ([{"custom_id": "a", "params": good}, {"custom_id": "a", "params": good}], "already used"),
                           ([{"custom_id": "bad id!", "params": good}], "custom_id")):
        with pytest.raises(anthropic.BadRequestError) as err:
            client.messages.batches.create(requests=requests)  # type: ignore[arg-type]
        assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
        assert says in err.value.body["error"]["message"]


def test_an_expired_window_ends_the_job_with_what_is_done(gw, upstream):
    _, rec, held = upstream
    held["on"] = True
    client = sdk(gw)
    uploaded = client.files.create(file=("in.jsonl", jsonl([chat_line(f"n{i}", f"Question {i}?") for i in range(4)])),
                                   purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: rec.inflight == 2, "two lines in flight")
    runner = gw.app[BATCHES].runner
    runner.clock = lambda: time.time() + 2 * 86400  # past the 24 h window
    runner.wake()
    # the lines not started expire at once; the two in flight finish
    wait_for(lambda: (c := client.batches.retrieve(batch.id).request_counts) is not None and c.failed == 2,
             "two lines expired")
    held["on"] = False
    done = wait_for(lambda: (b := client.batches.retrieve(batch.id)).status == "expired" and b, "the batch expired")
    assert done.request_counts is not None and (done.request_counts.completed, done.request_counts.failed) == (2, 2)
    assert done.expired_at is not None and done.output_file_id is not None
    errors = [orjson.loads(line) for line in client.files.content(done.error_file_id or "").text.splitlines()]
    assert {e["error"]["code"] for e in errors} == {"batch_expired"} and len(errors) == 2
    assert rec.hits == 2


def test_the_batch_api_is_local_only():
    from gateway.batches.service import unavailable
    from gateway.settings import Settings

    assert unavailable(Settings.load(env={})) is None
    shared = Settings.load(env={}, overrides={"state": {"backend": "redis"}})
    assert "state.backend: redis" in (unavailable(shared) or "")
    off = Settings.load(env={}, overrides={"batches": {"enabled": False}})
    assert "batches.enabled" in (unavailable(off) or "")
