"""`tierlane usage` and `tierlane cache purge|stats` with `state.backend: redis`: two gateway
replicas and a real Valkey, the CLI run in-process through its argparse entry point with a
settings file like the replicas' (as an operator's shell on any machine would load it).

`usage` reports the requests of both replicas (`--local`: one replica's ledger); with Valkey
killed it answers from the ledger with a warning. `cache purge` reaches every replica (an entry
stored through A is a miss on A and B); `cache stats` counts the fleet's entries; with Valkey
killed both exit 1 and print no result.

The upstream is a fixed-answer stub (tests/support/faults.py, mode "ok"), not llama.cpp: what is
checked is the gateway's own state as the CLI reports it (requests counted per replica and
tenant, cache entries stored and purged), not what an upstream answers or counts.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.auth import hash_key
from gateway.cli import main
from telemetry.core import FLEET_UNAVAILABLE
from tests.support.background import RunningApp
from tests.support.config import PASS_THROUGH, upstream_cfg
from tests.support.faults import Recorder, fault_app
from tests.support.fleet import settle as _settle
from tests.support.valkey import ValkeyServer

ACME, GLOBEX = "tl-acme-fleet-cli", "tl-globex-fleet-cli"
KEYS = [
    {"sha256": hash_key(ACME), "tenant": "acme", "app": "web"},
    {"sha256": hash_key(GLOBEX), "tenant": "globex", "app": "batch"},
]
MODEL = "m"
ANSWER = "Boil the water for ten minutes"
QUESTION = "How long should I boil water to make it safe to drink?"
PARAPHRASE = "how long do i need to boil water so that it is safe to drink"
OTHER = "What is the capital city of Australia?"
CACHE_ON = {**PASS_THROUGH["policy"], "cache": {"enabled": True, "verify": {"min_probability": 0.5}}}


@pytest.fixture(autouse=True)
def _no_tierlane_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI reads only the settings file each test writes (and the variables a test sets)."""
    for name in list(os.environ):
        if name.startswith("TIERLANE_"):
            monkeypatch.delenv(name)


def _replicas(make_gateway: Any, tmp_path: Path, valkey: ValkeyServer, upstream: RunningApp, *, cache: bool) -> list[RunningApp]:
    base = {**PASS_THROUGH, "embedder": {"enabled": cache}, "policy": CACHE_ON if cache else PASS_THROUGH["policy"]}
    return [
        make_gateway(
            base=base,
            state_dir=str(tmp_path / f"replica{i}"),
            auth={"mode": "keys", "keys": KEYS},
            upstreams=[upstream_cfg("up", upstream.url + "/v1", models=[MODEL], retries=0)],
            state={"backend": "redis", "url": valkey.url, "op_timeout_ms": 1000},
        )
        for i in range(2)
    ]


def _settings_file(tmp_path: Path, name: str, state_dir: Path, valkey: ValkeyServer, *, cache: bool = False) -> str:
    path = tmp_path / f"{name}.yaml"
    settings = {"state_dir": str(state_dir), "state": {"backend": "redis", "url": valkey.url, "op_timeout_ms": 1000}}
    if cache:
        settings["policy"] = CACHE_ON
    path.write_text(yaml.safe_dump(settings), encoding="utf-8")
    return str(path)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _chat(gw: RunningApp, text: str, key: str = ACME, *, store: bool = True) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", **({} if store else {"Cache-Control": "no-store"})}
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r


def _outcome(gw: RunningApp, text: str, key: str = ACME) -> str:
    """hit or miss, asked with no-store (asking stores nothing)."""
    return _chat(gw, text, key, store=False).headers["x-tierlane-cache"]


def _wait_for_hit(gw: RunningApp, text: str, key: str = ACME, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while _outcome(gw, text, key) != "hit":
        assert time.monotonic() < deadline, f"{text!r} never became a hit on {gw.url}"
        time.sleep(0.02)


def _by_tenant(body: dict[str, Any]) -> dict[str, int]:
    return {row["tenant"]: row["requests"] for row in body["data"]}


def test_usage_reports_every_replica_local_one_and_falls_back_when_the_store_is_down(
    bg, make_gateway, tmp_path, valkey, capsys, monkeypatch
):
    upstream = RunningApp(bg, fault_app("ok", Recorder(), text=ANSWER))
    a, b = _replicas(make_gateway, tmp_path, valkey, upstream, cache=False)
    # A: acme 3, globex 1; B: acme 2, globex 1
    for gw, key, n in ((a, ACME, 3), (a, GLOBEX, 1), (b, ACME, 2), (b, GLOBEX, 1)):
        for i in range(n):
            _chat(gw, f"request {i} from {key}", key)
    for gw in (a, b):
        _settle(bg, gw)
    config_a = _settings_file(tmp_path, "a", tmp_path / "replica0", valkey)

    rc, out, err = _cli(capsys, "usage", "--config", config_a, "--group-by", "tenant", "--format", "json")
    assert rc == 0 and "warning" not in err, err
    body = json.loads(out)
    assert body["source"] == "fleet" and "warning" not in body
    assert body["total"]["requests"] == 7 and _by_tenant(body) == {"acme": 5, "globex": 2}
    rc, out, _ = _cli(capsys, "usage", "--config", config_a, "--group-by", "tenant,app", "--format", "csv")
    assert rc == 0
    assert [line.split(",")[:3] for line in out.splitlines()[1:]] == [["acme", "web", "5"], ["globex", "batch", "2"]]
    rc, out, _ = _cli(capsys, "usage", "--config", config_a, "--tenant", "globex", "--format", "json")
    assert rc == 0 and json.loads(out)["total"]["requests"] == 2

    # --local: this replica's ledger only (the one --config or --state-dir names)
    rc, out, _ = _cli(capsys, "usage", "--config", config_a, "--local", "--group-by", "tenant", "--format", "json")
    body = json.loads(out)
    assert rc == 0 and body["source"] == "local" and _by_tenant(body) == {"acme": 3, "globex": 1}
    rc, out, _ = _cli(capsys, "usage", "--state-dir", str(tmp_path / "replica1"), "--local", "--format", "json")
    assert rc == 0 and json.loads(out)["total"]["requests"] == 3

    # the backend from the environment, as a replica's container has it: the fleet again
    monkeypatch.setenv("TIERLANE_STATE_BACKEND", "redis")
    monkeypatch.setenv("TIERLANE_STATE_URL", valkey.url)
    monkeypatch.setenv("TIERLANE_STATE_DIR", str(tmp_path / "replica1"))
    rc, out, _ = _cli(capsys, "usage", "--format", "json")
    body = json.loads(out)
    assert rc == 0 and body["source"] == "fleet" and body["total"]["requests"] == 7

    valkey.kill()
    rc, out, err = _cli(capsys, "usage", "--format", "json", "--group-by", "tenant")
    assert rc == 0
    assert "warning" in err and "did not answer" in err and valkey.url.rsplit("/", 1)[0] in err, err
    body = json.loads(out)
    assert body["source"] == "local" and body["warning"] == FLEET_UNAVAILABLE
    assert _by_tenant(body) == {"acme": 2, "globex": 1}  # replica1's ledger
    monkeypatch.delenv("TIERLANE_STATE_DIR")  # (the environment wins over the file)
    rc, out, err = _cli(capsys, "usage", "--config", config_a, "--format", "csv")
    assert rc == 0 and "warning" in err and out.splitlines()[1].split(",")[0] == "4"
    # no store and no ledger here: nothing to report
    monkeypatch.setenv("TIERLANE_STATE_DIR", str(tmp_path / "nowhere"))
    rc, out, err = _cli(capsys, "usage")
    assert rc == 1 and out == "" and "warning" in err and "no ledger at" in err


@pytest.mark.slow  # the embedder loads a real model on each replica
def test_cache_purge_and_stats_act_on_the_shared_cache_of_every_replica(bg, valkey, make_gateway, tmp_path, capsys):
    rec = Recorder()
    upstream = RunningApp(bg, fault_app("ok", rec, text=ANSWER))
    a, b = _replicas(make_gateway, tmp_path, valkey, upstream, cache=True)
    assert _chat(a, QUESTION).headers["x-tierlane-cache"] == "miss"
    assert _chat(a, OTHER, GLOBEX).headers["x-tierlane-cache"] == "miss"
    _wait_for_hit(a, QUESTION)  # admitted (after the answer was sent)
    _wait_for_hit(b, QUESTION)  # the exact key, from the store
    _wait_for_hit(b, PARAPHRASE)  # the vector, from the stream
    _wait_for_hit(b, OTHER, GLOBEX)
    # An operator's shell: the replicas' settings, a state directory of its own.
    shell = tmp_path / "shell"
    config = _settings_file(tmp_path, "shell", shell, valkey, cache=True)

    rc, out, _ = _cli(capsys, "cache", "stats", "--config", config)
    stats = json.loads(out)
    assert rc == 0 and stats["backend"] == "redis", stats
    assert stats["entries_known"] == 2 and stats["vectors"] == 2, stats

    rc, out, _ = _cli(capsys, "cache", "purge", "--config", config, "--tenant", "acme")
    assert rc == 0 and json.loads(out) == {"tenant": "acme", "deleted": 1}
    for gw in (a, b):
        assert _outcome(gw, QUESTION) == "miss"
        assert _outcome(gw, PARAPHRASE) == "miss"
        assert _outcome(gw, OTHER, GLOBEX) == "hit"  # another tenant's entry stays
    assert not shell.exists()  # no embedded cache was opened (or purged) instead
    rc, out, _ = _cli(capsys, "cache", "stats", "--config", config)
    assert rc == 0 and json.loads(out)["entries_known"] == 1

    # by key: the x-tierlane-cache-key of a hit on B
    key = _chat(b, OTHER, GLOBEX, store=False).headers["x-tierlane-cache-key"]
    rc, out, _ = _cli(capsys, "cache", "purge", "--config", config, "--key", key)
    assert rc == 0 and json.loads(out) == {"key": key, "deleted": 1}
    for gw in (a, b):
        assert _outcome(gw, OTHER, GLOBEX) == "miss"
    rc, out, _ = _cli(capsys, "cache", "stats", "--config", config)
    assert rc == 0 and json.loads(out)["entries_known"] == 0 and json.loads(out)["vectors"] == 0

    # The store down: no result, and exit status 1 (a purge never claims what it could not do).
    _chat(a, QUESTION)
    _wait_for_hit(b, QUESTION)
    valkey.kill()
    rc, out, err = _cli(capsys, "cache", "purge", "--config", config, "--tenant", "acme")
    assert rc == 1 and out == "" and "unavailable" in err and "nothing was purged" in err, err
    rc, out, err = _cli(capsys, "cache", "stats", "--config", config)
    assert rc == 1 and out == "" and "unavailable" in err, err
    assert not shell.exists()
    valkey.start()  # the replicas stop against a live store (a dead one makes each wait out its shutdown)
