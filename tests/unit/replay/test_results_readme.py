"""The README results block: rewritten between its markers from the result files, nothing else touched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.results_readme import END, START, main, rewrite


def _results(tmp_path: Path) -> Path:
    results = tmp_path / "results"
    results.mkdir()
    (results / "proxy_overhead.json").write_text(json.dumps({
        "what": "added latency", "generated_at": "2026-01-01T00:00:00Z", "machine": {"cpus": 2},
        "results": {"concurrency_1": {"direct": {"p50_ms": 0.5, "rps": 900.0}, "tierlane": {"p50_ms": 1.5, "rps": 500.0},
                                      "added_p50_ms": 1.0, "added_p99_ms": 3.0, "throughput_ratio": 0.55}},
    }))
    (results / "other.json").write_text(json.dumps({"benchmark": "other", "score": 0.91, "meets_target": True}))
    (results / "broken.json").write_text("{not json")
    return results


def test_block_is_appended_then_replaced_in_place(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# title\n\nbody text\n")
    results = _results(tmp_path)
    assert main(["--readme", str(readme), "--results", str(results)]) == 0
    first = readme.read_text()
    assert first.startswith("# title\n\nbody text\n\n" + START)
    assert first.rstrip().endswith(END)
    assert "| 1 | 0.5 | 1.5 | 1 | 3 | 900 | 500 | 0.55 |" in first
    assert "| score | 0.91 |" in first and "### broken" not in first
    readme.write_text(first + "\ntrailing section\n")
    (results / "other.json").write_text(json.dumps({"benchmark": "other", "score": 0.5}))
    assert main(["--readme", str(readme), "--results", str(results), "--check"]) == 1
    assert main(["--readme", str(readme), "--results", str(results)]) == 0
    second = readme.read_text()
    assert "| score | 0.5 |" in second and second.count(START) == 1
    assert second.endswith("\ntrailing section\n") and second.startswith("# title\n\nbody text\n")
    assert main(["--readme", str(readme), "--results", str(results), "--check"]) == 0


def test_a_lone_marker_is_refused() -> None:
    with pytest.raises(ValueError, match="one results marker"):
        rewrite(f"text\n{START}\nno end\n", "block")
