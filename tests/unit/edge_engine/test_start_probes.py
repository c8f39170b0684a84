"""The start probes' costs are kept between starts: reused while fresh, timed again when stale,
damaged, or measured for another model file, context shape or thread count."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from edge_engine import EdgeSettings, start_probes
from edge_engine.speculative import DraftCost
from edge_engine.step_cost import StepCost

FITTED = StepCost(256, step_ms=150.0, ms_token=3.7, ms_cell=0.0042)
DRAFT = DraftCost(first=0.9, row=0.5)


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Which probes ran; each returns a fixed fit."""
    ran: list[str] = []

    def steps(ctx: Any, model: Any, seq: int, *, step_ms: float | None, max_tokens: int) -> StepCost:
        ran.append("steps")
        return FITTED if step_ms is not None else StepCost(max_tokens)

    def draft(ctx: Any, model: Any, seq: int) -> DraftCost:
        ran.append("draft")
        return DRAFT

    monkeypatch.setattr(StepCost, "calibrate", staticmethod(steps))
    monkeypatch.setattr(DraftCost, "calibrate", staticmethod(draft))
    return ran


def parts(tmp_path: Path, **settings: Any) -> tuple[Any, Any, EdgeSettings]:
    weights = tmp_path / "model.gguf"
    if not weights.exists():
        weights.write_bytes(b"weights")
    settings = {"n_threads": 1, "probe_cache_dir": str(tmp_path / "kept"), **settings}
    return SimpleNamespace(path=weights), SimpleNamespace(n_ctx=1024, n_batch=512), EdgeSettings(**settings)


def start(tmp_path: Path, now: float = 1000.0, speculate: bool = True, **settings: Any) -> start_probes.StartCosts:
    model, ctx, s = parts(tmp_path, **settings)
    return start_probes.start_costs(ctx, model, 9, s, speculate=speculate, clock=lambda: now)


def test_a_second_start_reuses_the_costs_the_first_timed(tmp_path: Path, timed: list[str]) -> None:
    first = start(tmp_path)
    assert timed == ["steps", "draft"] and first == start_probes.StartCosts(FITTED, DRAFT)
    assert start(tmp_path, now=2000.0) == first and timed == ["steps", "draft"]  # nothing timed again
    assert len(list((tmp_path / "kept").glob("start-probes-*.json"))) == 1


def test_stale_costs_are_timed_again(tmp_path: Path, timed: list[str]) -> None:
    start(tmp_path, probe_cache_ttl_s=60.0)
    start(tmp_path, now=1059.0, probe_cache_ttl_s=60.0)
    assert timed == ["steps", "draft"]
    start(tmp_path, now=1061.0, probe_cache_ttl_s=60.0)
    assert timed == ["steps", "draft"] * 2


@pytest.mark.parametrize("other", [{"n_threads": 2}, {"n_ctx": 2048}, {"prefill_step_ms": 100.0}, {"flash_attn": False}])
def test_other_settings_time_their_own(tmp_path: Path, timed: list[str], other: dict[str, Any]) -> None:
    start(tmp_path)
    model, _, s = parts(tmp_path, **other)
    ctx = SimpleNamespace(n_ctx=other.get("n_ctx", 1024), n_batch=512)
    start_probes.start_costs(ctx, model, 9, s, speculate=True, clock=lambda: 1001.0)
    assert timed == ["steps", "draft"] * 2


def test_a_new_model_file_is_timed_again(tmp_path: Path, timed: list[str]) -> None:
    start(tmp_path)
    (tmp_path / "model.gguf").write_bytes(b"other weights")
    start(tmp_path)
    assert timed == ["steps", "draft"] * 2
    (tmp_path / "model.gguf").write_bytes(b"other weightz")  # the same size, other content
    start(tmp_path)
    assert timed == ["steps", "draft"] * 3


def test_a_damaged_file_is_timed_again_and_replaced(tmp_path: Path, timed: list[str]) -> None:
    start(tmp_path)
    (kept,) = (tmp_path / "kept").glob("*.json")
    kept.write_text("{not json")
    assert start(tmp_path) == start_probes.StartCosts(FITTED, DRAFT)
    assert json.loads(kept.read_text())["steps"]["ms_cell"] == FITTED.ms_cell
    assert timed == ["steps", "draft"] * 2


def test_without_a_directory_or_a_writable_one_every_start_times_them(tmp_path: Path, timed: list[str]) -> None:
    start(tmp_path, probe_cache_dir=None)
    start(tmp_path, probe_cache_dir=None)
    (tmp_path / "file").write_text("")
    start(tmp_path, probe_cache_dir=str(tmp_path / "file" / "under"))  # cannot be created
    assert timed == ["steps", "draft"] * 3


def test_speculation_off_times_no_drafts_and_a_failed_fit_is_not_kept(tmp_path: Path, timed: list[str], monkeypatch) -> None:
    assert start(tmp_path, speculate=False).draft is None and timed == ["steps"]
    monkeypatch.setattr(StepCost, "calibrate", staticmethod(lambda *a, **k: timed.append("steps") or StepCost(16)))
    start(tmp_path, now=1.0, speculate=False, probe_cache_ttl_s=0.0, n_threads=3)
    start(tmp_path, now=1.0, speculate=False, probe_cache_ttl_s=0.0, n_threads=3)
    assert timed == ["steps"] * 3


def test_kept_costs_survive_a_copy_that_moves_the_mtime_and_are_readable_by_other_users(
    tmp_path: Path, timed: list[str]
) -> None:
    """An image times them as root at build; its gateway runs as another user, on files a layer copied."""
    import os

    start(tmp_path)
    (kept,) = (tmp_path / "kept").glob("*.json")
    assert kept.stat().st_mode & 0o777 == 0o644
    weights = tmp_path / "model.gguf"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns // 1_000_000_000 * 1_000_000_000 + 1_000_000_000))
    start(tmp_path)
    assert timed == ["steps", "draft"]  # the same key: nothing timed again
