"""What the gateway exposes to whom: open mode only on loopback, keys from a mounted file,
global vs tenant admin keys on /v1/usage, /v1/cache and /v1/shadow, /metrics behind a global
admin key, and the start-up line naming the auth mode and listen address."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from pydantic import ValidationError

from gateway import serve_cli
from gateway.auth import hash_key
from gateway.cli import main
from gateway.settings import Settings, is_loopback
from tests.support.background import RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, fault_app

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
ACME, GLOBEX, ACME_ADMIN, OPS = "tl-acme-user", "tl-globex-user", "tl-acme-admin", "tl-ops-admin"
KEYS = [
    {"sha256": hash_key(ACME), "tenant": "acme", "app": "web"},
    {"sha256": hash_key(GLOBEX), "tenant": "globex", "app": "web"},
    {"sha256": hash_key(ACME_ADMIN), "tenant": "acme", "admin": True, "admin_scope": "tenant"},
    {"sha256": hash_key(OPS), "tenant": "ops", "admin": True},
]
NETWORK_HOSTS = ["0.0.0.0", "::", "", "10.1.2.3", "192.168.0.7", "fd00::1", "gateway.example.com", "::ffff:10.0.0.1"]
LOOPBACK_HOSTS = ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LOCALHOST", "::ffff:127.0.0.1"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# --- open mode binds loopback only -------------------------------------------------------------


@pytest.mark.parametrize("host", LOOPBACK_HOSTS)
def test_loopback_addresses(host: str) -> None:
    assert is_loopback(host)
    assert Settings.load(env={}, overrides={"server": {"host": host}}).auth.mode == "open"


@pytest.mark.parametrize("host", NETWORK_HOSTS)
def test_open_mode_on_a_network_address_is_refused(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(ValidationError, match="allow_open_on_network"):
        Settings.load(env={}, overrides={"server": {"host": host}})


def test_the_shipped_image_environment_is_refused_in_open_mode() -> None:
    # What deploy/Dockerfile sets, minus the keys: the embedded default mode is open.
    with pytest.raises(ValidationError, match="not a loopback address"):
        Settings.load(env={"TIERLANE_HOST": "0.0.0.0"})
    with pytest.raises(ValidationError, match="not a loopback address"):
        Settings.load(env={"TIERLANE_HOST": "0.0.0.0", "TIERLANE_AUTH_MODE": "open"})


def test_the_override_allows_open_mode_on_the_network() -> None:
    env = {"TIERLANE_HOST": "0.0.0.0", "TIERLANE_ALLOW_OPEN_ON_NETWORK": "1"}
    settings = Settings.load(env=env)
    assert (settings.auth.mode, settings.server.host, settings.auth.allow_open_on_network) == ("open", "0.0.0.0", True)
    settings = Settings.load(env={}, overrides={"server": {"host": "::"}, "auth": {"allow_open_on_network": True}})
    assert settings.server.host == "::"
    with pytest.raises(ValidationError, match="allow_open_on_network"):
        Settings.load(env={"TIERLANE_HOST": "0.0.0.0", "TIERLANE_ALLOW_OPEN_ON_NETWORK": "maybe"})


def test_keys_mode_may_listen_anywhere() -> None:
    settings = Settings.load(env={"TIERLANE_HOST": "0.0.0.0", "TIERLANE_AUTH_MODE": "keys"})
    assert (settings.auth.mode, settings.server.host) == ("keys", "0.0.0.0")


def _no_tierlane_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("TIERLANE_"):
            monkeypatch.delenv(name)


def _serve_config(tmp_path: Path, **extra: Any) -> Path:
    data = {
        "state_dir": str(tmp_path / "state"),
        "server": {"uvloop": False, "port": 18080},
        "edge": {"enabled": False},
        "embedder": {"enabled": False},
        **extra,
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_serve_refuses_open_mode_on_all_interfaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_tierlane_env(monkeypatch)
    started: list[Any] = []
    monkeypatch.setattr(serve_cli.web, "run_app", lambda *a, **kw: started.append(kw))
    assert main(["serve", "--config", str(_serve_config(tmp_path)), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "refusing to start" in err and "'0.0.0.0'" in err and "auth.mode: keys" in err
    assert started == []


def test_serve_logs_the_auth_mode_and_listen_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _no_tierlane_env(monkeypatch)
    started: list[dict[str, Any]] = []
    monkeypatch.setattr(serve_cli.web, "run_app", lambda app, **kw: started.append(kw))
    caplog.set_level(logging.INFO, logger=serve_cli.__name__)

    assert main(["serve", "--config", str(_serve_config(tmp_path))]) == 0
    assert started[-1]["host"] == "127.0.0.1"
    [record] = [r for r in caplog.records if r.name == serve_cli.__name__]
    assert record.levelno == logging.WARNING
    assert "auth mode open on 127.0.0.1:18080 (loopback only)" in record.getMessage()

    caplog.clear()
    config = _serve_config(tmp_path, auth={"mode": "keys", "keys": KEYS})
    assert main(["serve", "--config", str(config), "--host", "0.0.0.0"]) == 0
    assert started[-1]["host"] == "0.0.0.0"
    [record] = [r for r in caplog.records if r.name == serve_cli.__name__]
    assert record.levelno == logging.INFO
    message = record.getMessage()
    assert "auth mode keys on 0.0.0.0:18080 (reachable from the network)" in message
    assert "4 keys (1 global admin, 1 tenant admin)" in message and "/metrics: global admin key" in message


# --- keys from a mounted file --------------------------------------------------------------------


def test_keys_file_adds_keys_from_a_secret(tmp_path: Path) -> None:
    listed = tmp_path / "keys.yaml"
    listed.write_text(yaml.safe_dump(KEYS[2:]))
    inline = {"auth": {"mode": "keys", "keys": KEYS[:2]}}
    settings = Settings.load(env={"TIERLANE_API_KEYS_FILE": str(listed), "TIERLANE_HOST": "0.0.0.0"}, overrides=inline)
    assert [(k.tenant, k.admin, k.admin_scope) for k in settings.auth.keys] == [
        ("acme", False, "global"), ("globex", False, "global"), ("acme", True, "tenant"), ("ops", True, "global"),
    ]
    as_json = tmp_path / "keys.json"
    as_json.write_text(json.dumps({"keys": [{"sha256": hash_key(ACME), "tenant": "acme"}]}))
    settings = Settings.load(env={}, overrides={"auth": {"mode": "keys", "keys_file": str(as_json)}})
    assert [k.sha256 for k in settings.auth.keys] == [hash_key(ACME)]


def test_a_missing_or_bad_keys_file_stops_the_load(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot be read"):
        Settings.load(env={"TIERLANE_API_KEYS_FILE": str(tmp_path / "absent.yaml")})
    bad = tmp_path / "bad.yaml"
    bad.write_text("sha256: abc\n")
    with pytest.raises(ValueError, match="must hold a list"):
        Settings.load(env={"TIERLANE_API_KEYS_FILE": str(bad)})
    bad.write_text("- {sha256: plaintext-key, tenant: acme}\n")
    with pytest.raises(ValidationError, match="64 hex"):
        Settings.load(env={"TIERLANE_API_KEYS_FILE": str(bad)})


def test_tenant_scope_is_for_admin_keys() -> None:
    key = {"sha256": hash_key(ACME), "tenant": "a", "admin_scope": "tenant"}
    with pytest.raises(ValidationError, match="admin_scope: tenant is for admin keys"):
        Settings.load(env={}, overrides={"auth": {"keys": [key]}})


# --- admin scopes through a real gateway ---------------------------------------------------------


@pytest.fixture
def metered(bg, make_gateway) -> RunningApp:
    """A keyed, metering gateway with a little traffic of acme and globex in its ledger."""
    up = RunningApp(bg, fault_app("ok", Recorder()))
    gw = make_gateway(
        upstreams=[upstream_cfg("a", up.url + "/v1")],
        auth={"mode": "keys", "keys": KEYS},
        telemetry={"tracing": False, "metrics": True, "metering": True},
    )
    for key in (ACME, ACME, GLOBEX):
        assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers=bearer(key)).status_code == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the meter hook runs after the answer is sent
        body = httpx.get(gw.url + "/v1/usage?group_by=tenant", headers=bearer(OPS)).json()
        if body["total"]["requests"] == 3:
            break
        time.sleep(0.05)
    return gw


def test_global_admin_reads_every_tenants_usage(metered: RunningApp) -> None:
    body = httpx.get(metered.url + "/v1/usage?group_by=tenant", headers=bearer(OPS)).json()
    assert {r["tenant"]: r["requests"] for r in body["data"]} == {"acme": 2, "globex": 1}
    r = httpx.get(metered.url + "/v1/usage", params={"tenant": "globex"}, headers=bearer(OPS))
    assert r.status_code == 200 and r.json()["total"]["requests"] == 1


def test_tenant_admin_reads_only_its_own_tenants_usage(metered: RunningApp) -> None:
    r = httpx.get(metered.url + "/v1/usage?group_by=tenant", headers=bearer(ACME_ADMIN))
    assert r.status_code == 200
    body = r.json()
    assert {row["tenant"]: row["requests"] for row in body["data"]} == {"acme": 2}
    assert body["total"]["requests"] == 2 and body["filters"] == {"tenant": "acme"}
    # The same scope on the ungrouped totals and the CSV rendering.
    assert httpx.get(metered.url + "/v1/usage", headers=bearer(ACME_ADMIN)).json()["total"]["requests"] == 2
    csv_text = httpx.get(
        metered.url + "/v1/usage?group_by=tenant", headers={**bearer(ACME_ADMIN), "Accept": "text/csv"}
    ).text
    assert "globex" not in csv_text and "acme" in csv_text
    assert httpx.get(metered.url + "/v1/usage?tenant=acme", headers=bearer(ACME_ADMIN)).status_code == 200
    denied = httpx.get(metered.url + "/v1/usage?tenant=globex", headers=bearer(ACME_ADMIN))
    assert denied.status_code == 403
    assert denied.json()["error"]["type"] == "permission_error" and "'globex'" in denied.json()["error"]["message"]
    assert httpx.get(metered.url + "/v1/usage", headers=bearer(ACME)).status_code == 403


def test_metrics_need_a_global_admin_key(metered: RunningApp) -> None:
    assert httpx.get(metered.url + "/metrics").status_code == 401
    for key in (ACME, ACME_ADMIN):
        r = httpx.get(metered.url + "/metrics", headers=bearer(key))
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    r = httpx.get(metered.url + "/metrics", headers=bearer(OPS))
    assert r.status_code == 200 and "tierlane_cost_usd" in r.text
    # The probes stay open for kubelet and the image's HEALTHCHECK.
    assert httpx.get(metered.url + "/healthz").status_code == 200
    assert httpx.get(metered.url + "/readyz").status_code == 200


def test_metrics_auth_none_makes_metrics_public(make_gateway) -> None:
    telemetry = {"tracing": False, "metrics": True, "metrics_auth": "none"}
    gw = make_gateway(auth={"mode": "keys", "keys": KEYS}, telemetry=telemetry)
    r = httpx.get(gw.url + "/metrics")
    assert r.status_code == 200 and "tierlane_" in r.text
    assert httpx.get(gw.url + "/v1/usage").status_code == 401


def test_open_mode_on_loopback_reads_metrics_without_a_key(make_gateway) -> None:
    gw = make_gateway(telemetry={"tracing": False, "metrics": True})
    assert httpx.get(gw.url + "/metrics").status_code == 200


def test_tenant_admin_purges_only_its_own_tenants_cache(make_gateway) -> None:
    gw = make_gateway(auth={"mode": "keys", "keys": KEYS}, policy={"cache": {"enabled": True}})
    purge = gw.url + "/v1/cache"
    r = httpx.delete(purge, params={"tenant": "acme"}, headers=bearer(ACME_ADMIN))
    assert r.status_code == 200 and r.json()["tenant"] == "acme"
    r = httpx.delete(purge, params={"tenant": "globex"}, headers=bearer(ACME_ADMIN))
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    # An entry key does not say whose entry it is: only a global admin purges by key.
    r = httpx.delete(purge + "/" + "ab" * 32, headers=bearer(ACME_ADMIN))
    assert r.status_code == 403
    assert httpx.delete(purge, params={"tenant": "globex"}, headers=bearer(OPS)).status_code == 200
    assert httpx.delete(purge + "/" + "ab" * 32, headers=bearer(OPS)).status_code == 404  # allowed, no such entry
    assert httpx.delete(purge, params={"tenant": "acme"}, headers=bearer(ACME)).status_code == 403


def test_shadow_report_needs_a_global_admin(make_gateway) -> None:
    gw = make_gateway(auth={"mode": "keys", "keys": KEYS})
    r = httpx.get(gw.url + "/v1/shadow", headers=bearer(ACME_ADMIN))
    assert r.status_code == 403 and "global admin" in r.json()["error"]["message"]
    assert httpx.get(gw.url + "/v1/shadow", headers=bearer(OPS)).status_code == 200
