"""The probe cache of `policies.edge_quality.runner`: a file damaged by a run cut short costs its damaged lines, not the run."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from policies.edge_quality.probes import load_probes
from policies.edge_quality.runner import MAX_TOKENS, EdgeRecord, run_probes

PROBES = load_probes()[:4]
MODEL = "0" * 64


def line(i: int) -> bytes:
    p = PROBES[i]
    record = EdgeRecord(id=p.id, family=p.family, split=p.split, text="x", finish_reason="stop", completion_tokens=1,
                        prompt_tokens=3, logprobs=[-0.1], entropies=[0.2])
    return (json.dumps({"key": f"{MODEL}|{MAX_TOKENS}|{p.prompt}", **record.to_json()}) + "\n").encode()


def cached(cache: Path, *which: int) -> list[EdgeRecord]:
    """What run_probes returns for these probes, all of which the cache must hold (there is no engine)."""
    return asyncio.run(run_probes([PROBES[i] for i in which], model_sha256=MODEL, cache=cache))


@pytest.mark.parametrize(
    "tail",
    [line(2)[:40], b"\0" * 4096, line(2)[:40] + b"\0" * 100],
    ids=["a partial line", "NUL bytes", "a partial line then NUL bytes"],
)
def test_a_damaged_tail_is_dropped_with_a_warning_naming_the_file(
    tmp_path: Path, tail: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "records.jsonl"
    cache.write_bytes(line(0) + line(1) + tail)
    with caplog.at_level(logging.WARNING, "policies.edge_quality.runner"):
        records = cached(cache, 0, 1)
    assert [r.id for r in records] == [PROBES[0].id, PROBES[1].id]
    assert any(str(cache) in r.getMessage() and "damaged" in r.getMessage() for r in caplog.records)
    assert cache.read_bytes() == line(0) + line(1), "the file is cut back to its good lines"
    # what a later run appends is a line of its own, and no warning comes again
    with cache.open("ab") as fh:
        fh.write(line(2))
    caplog.clear()
    assert len(cached(cache, 0, 1, 2)) == 3 and not caplog.records


def test_damage_in_the_middle_costs_only_its_lines(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "records.jsonl"
    # a partial line a later append was glued to (both lost), NUL bytes before a later append (kept),
    # and a row of another shape
    cache.write_bytes(line(0) + line(1)[:30] + line(1) + b"\0" * 64 + line(2) + b'{"key": "k", "other": 1}\n' + line(3))
    with caplog.at_level(logging.WARNING, "policies.edge_quality.runner"):
        records = cached(cache, 0, 2, 3)
    assert [r.id for r in records] == [PROBES[i].id for i in (0, 2, 3)]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert str(cache) in warning and "dropped 2 damaged line(s) (line 2, 4 of 5" in warning
    assert cache.read_bytes() == line(0) + line(2) + line(3)
