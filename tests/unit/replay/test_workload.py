"""Reading workload files: accepted shapes, order, and the errors bad lines get."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.replay.workload import WorkloadError, read_lines, read_workload, write_workload


def test_items_come_back_sorted_by_offset_with_defaults_filled() -> None:
    lines = [
        json.dumps({"at": 2.5, "kind": "hard", "body": {"messages": [{"role": "user", "content": "b"}]}}),
        "",
        "# a comment",
        json.dumps({"messages": [{"role": "user", "content": "a"}], "model": "edge"}),
        json.dumps({"at": 1, "body": {"model": "m", "prompt": "c"}}),
    ]
    items = read_lines(lines)
    assert [i.at for i in items] == [0.0, 1.0, 2.5]
    assert items[0].body["model"] == "edge" and items[0].operation == "chat"
    assert items[1].operation == "completions" and items[1].path == "/v1/completions"
    assert items[2].body["model"] == "auto" and items[2].kind == "hard"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"at": 1}', "needs a `body`"),
        ('{"at": -1, "body": {"messages": []}}', "`at` must be a number"),
        ('{"at": "soon", "body": {"messages": []}}', "`at` must be a number"),
        ('{"body": {"model": "m"}, "operation": "chat"}', "needs a `messages` list"),
        ('{"body": {"messages": []}, "operation": "embeddings"}', "operation must be one of"),
    ],
)
def test_bad_lines_name_the_line(line: str, message: str) -> None:
    good = json.dumps({"messages": [{"role": "user", "content": "ok"}]})
    with pytest.raises(WorkloadError, match=message) as info:
        read_lines([good, line], "wl.jsonl")
    assert "wl.jsonl:2" in str(info.value)


def test_empty_and_missing_files_are_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n# nothing\n")
    with pytest.raises(WorkloadError, match="no requests"):
        read_workload(empty)
    with pytest.raises(WorkloadError, match="no such file"):
        read_workload(tmp_path / "absent.jsonl")


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    records = [{"at": i / 10, "kind": "simple", "body": {"messages": [{"role": "user", "content": f"q{i}"}]}} for i in range(3)]
    assert write_workload(path, records) == 3
    items = read_workload(path)
    assert [i.body["messages"][0]["content"] for i in items] == ["q0", "q1", "q2"]
