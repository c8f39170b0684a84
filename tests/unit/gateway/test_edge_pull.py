"""`tierlane edge pull --config FILE` against a local hub server, and the gateway refusing to start without the file.

The config names a hub file; HF_ENDPOINT points the pull at tests/support/hub_server.py (no
network) and TIERLANE_MODEL_CACHE at a temporary cache. HF_HUB_OFFLINE=1 stays set throughout:
it must not stop the set-up step.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.serve_cli import model_problem
from gateway.settings import Settings
from tests.support.hub_server import HubServer, RunningHub, gguf_bytes

DATA = gguf_bytes(600_000, seed=3)
DIGEST = hashlib.sha256(DATA).hexdigest()
MODEL = "hf://acme/tiny-GGUF@v2/tiny.gguf"


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[RunningHub]:
    running = RunningHub(HubServer({"acme/tiny-GGUF/v2/tiny.gguf": DATA}))
    monkeypatch.setenv("HF_ENDPOINT", running.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TIERLANE_MODEL_CACHE", str(tmp_path / "models"))
    for name in ("TIERLANE_CONFIG", "TIERLANE_EDGE_MODEL", "TIERLANE_EDGE_MODEL_PATH", "TIERLANE_EDGE_MODEL_SHA256"):
        monkeypatch.delenv(name, raising=False)
    yield running
    running.close()


def config(tmp_path: Path, digest: str = DIGEST) -> Path:
    path = tmp_path / "tierlane.yaml"
    path.write_text(f"edge:\n  model: {MODEL}\n  model_sha256: {digest}\n", encoding="utf-8")
    return path


def test_pull_downloads_verifies_and_a_second_pull_is_a_no_op(
    hub: RunningHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = config(tmp_path)
    assert main(["edge", "pull", "--config", str(cfg)]) == 0
    first = json.loads(capsys.readouterr().out)
    placed = tmp_path / "models" / "acme" / "tiny-GGUF" / "v2" / "tiny.gguf"
    assert first == {"model": MODEL, "path": str(placed), "sha256": DIGEST, "pulled": True,
                     "downloaded_bytes": len(DATA), "resumed_from": 0}
    assert placed.read_bytes() == DATA
    assert main(["edge", "pull", "--config", str(cfg)]) == 0
    assert json.loads(capsys.readouterr().out)["pulled"] is False
    assert [s.status for s in hub.server.seen] == [302, 200], "the second pull asked nothing"


def test_the_gateway_refuses_to_start_until_the_model_is_pulled(
    hub: RunningHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = config(tmp_path)
    settings = Settings.load(cfg)
    problem = model_problem(settings, str(cfg))
    assert problem and f"run `tierlane edge pull --config {cfg}`" in problem and "never downloads" in problem
    # `tierlane serve` stops there, before anything starts, with the same words
    assert main(["serve", "--config", str(cfg)]) == 2
    assert f"refusing to start: {problem}" in capsys.readouterr().err
    assert hub.server.seen == [], "starting never downloads"

    assert main(["edge", "pull", "--config", str(cfg)]) == 0
    assert model_problem(Settings.load(cfg), str(cfg)) is None
    assert Settings.load(cfg).edge.resolved_model().sha256 == DIGEST


def test_a_file_changed_in_the_cache_stops_the_start(hub: RunningHub, tmp_path: Path) -> None:
    cfg = config(tmp_path)
    assert main(["edge", "pull", "--config", str(cfg)]) == 0
    placed = Settings.load(cfg).edge.resolved_model_path()
    placed.write_bytes(DATA[:-1] + b"\0")
    got = hashlib.sha256(DATA[:-1] + b"\0").hexdigest()
    problem = model_problem(Settings.load(cfg), str(cfg))
    assert problem and f"expected {DIGEST}, got {got}" in problem and f"`tierlane edge pull --config {cfg}`" in problem


def test_a_wrong_pin_is_refused_by_the_pull_naming_both_digests(
    hub: RunningHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wrong = hashlib.sha256(b"another").hexdigest()
    assert main(["edge", "pull", "--config", str(config(tmp_path, wrong))]) == 1
    err = capsys.readouterr().err
    assert f"expected {wrong}, got {DIGEST}" in err and "refused" in err
    folder = tmp_path / "models" / "acme" / "tiny-GGUF" / "v2"
    assert list(folder.iterdir()) == []


def test_the_pulls_bounds_are_options_and_their_stop_is_a_clear_error(
    hub: RunningHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = str(config(tmp_path))
    assert main(["edge", "pull", "--config", cfg, "--max-gb", "0.0001"]) == 1  # 107,374 bytes: less than the file
    err = capsys.readouterr().err
    assert f"announces {len(DATA)} bytes, more than 107374 bytes, the largest file" in err and "--max-gb" in err
    assert main(["edge", "pull", "--config", cfg, "--max-gb", "0"]) == 2
    assert "--max-gb must be above 0" in capsys.readouterr().err
    assert main(["edge", "pull", "--config", cfg, "--max-time-s", "0", "--min-rate-kib", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["downloaded_bytes"] == len(DATA)


def test_pull_for_the_bundled_model_downloads_nothing(hub: RunningHub, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["edge", "pull"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "bundled" and out["pulled"] is False
    assert hub.server.seen == []


def test_the_model_variables_reach_the_edge_settings(tmp_path: Path) -> None:
    env = {"TIERLANE_EDGE_MODEL": MODEL, "TIERLANE_EDGE_MODEL_SHA256": DIGEST,
           "TIERLANE_MODEL_CACHE": str(tmp_path), "HF_ENDPOINT": "http://mirror.example"}
    edge = Settings.load(env=env).edge
    assert (edge.model, edge.model_sha256, edge.model_cache_dir, edge.hub_endpoint) == (
        MODEL, DIGEST, str(tmp_path), "http://mirror.example")
    # the older variable still names a path, and replaces a file's edge.model
    older = Settings.load(config(tmp_path), env={"TIERLANE_EDGE_MODEL_PATH": "/models/m.gguf"}).edge
    assert older.model == "/models/m.gguf" and older.model_path is None
    assert Settings.pull_command(env={"TIERLANE_CONFIG": "/etc/t l.yaml"}) == "tierlane edge pull --config '/etc/t l.yaml'"
    assert Settings.pull_command(env={}) == "tierlane edge pull"
