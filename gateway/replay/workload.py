"""Workload files: JSON lines, one request each, with an optional arrival offset `at` in seconds."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OPERATIONS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


class WorkloadError(ValueError):
    """A workload file that cannot be replayed; the message names the file and line."""


@dataclass(slots=True, frozen=True)
class WorkItem:
    """One request of a workload: when to send it (seconds after the start) and what to send."""

    index: int
    at: float
    body: dict[str, Any]
    operation: str = "chat"
    kind: str | None = None  # free label from the generator (repeat, paraphrase, simple, hard)
    id: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    expected: Any = None  # the right answer, when the workload carries one
    check: str | None = None  # the checker that compares an answer with `expected` (policies.edge_quality)

    @property
    def path(self) -> str:
        return OPERATIONS[self.operation]


def parse_line(raw: dict[str, Any], index: int, where: str) -> WorkItem:
    """One decoded line. Accepts `{"at", "body", ...}` or a bare OpenAI request body."""
    if not isinstance(raw, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    body = raw.get("body", raw if "messages" in raw or "prompt" in raw else None)
    if not isinstance(body, dict):
        raise WorkloadError(f"{where}: needs a `body` object (an OpenAI request) or `messages`/`prompt` at top level")
    operation = raw.get("operation") or ("completions" if "prompt" in body and "messages" not in body else "chat")
    if operation not in OPERATIONS:
        raise WorkloadError(f"{where}: operation must be one of {', '.join(OPERATIONS)}, got {operation!r}")
    if operation == "chat" and not isinstance(body.get("messages"), list):
        raise WorkloadError(f"{where}: a chat request needs a `messages` list")
    if operation == "completions" and not isinstance(body.get("prompt"), str | list):
        raise WorkloadError(f"{where}: a completions request needs a `prompt`")
    at = raw.get("at", 0.0)
    if isinstance(at, bool) or not isinstance(at, int | float) or at < 0:
        raise WorkloadError(f"{where}: `at` must be a number of seconds >= 0, got {at!r}")
    headers = raw.get("headers") or {}
    if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
        raise WorkloadError(f"{where}: `headers` must map names to strings")
    body = {"model": "auto", **body}
    check = raw.get("check")
    if check is not None:
        expected_probe(check, raw.get("expected"), where)  # fails here, not mid-replay
    kind = raw.get("kind")
    ident = raw.get("id")
    return WorkItem(
        index=index,
        at=float(at),
        body=body,
        operation=operation,
        kind=str(kind) if kind is not None else None,
        id=str(ident) if ident is not None else None,
        headers=dict(headers),
        expected=raw.get("expected"),
        check=str(check) if check is not None else None,
    )


_EXPECTED_KEYS = frozenset({"answer", "aliases", "distractors", "choices"})


def expected_probe(check: Any, expected: Any, where: str = "<workload>") -> Any:
    """The checkable task of a workload line: `check` names a checker of policies.edge_quality,
    `expected` is the answer (a string) or `{answer, aliases?, distractors?, choices?}`."""
    from policies.edge_quality.checkers import CHECKERS
    from policies.edge_quality.probes import Probe

    if not isinstance(check, str) or check not in CHECKERS:
        raise WorkloadError(f"{where}: unknown checker {check!r}; known: {', '.join(sorted(CHECKERS))}")
    fields = {"answer": expected} if isinstance(expected, str) else expected
    if not isinstance(fields, dict) or not isinstance(fields.get("answer"), str) or set(fields) - _EXPECTED_KEYS:
        raise WorkloadError(f"{where}: `expected` must be a string or an object with a string `answer` "
                            f"(and optional {', '.join(sorted(_EXPECTED_KEYS - {'answer'}))})")
    lists = {k: tuple(str(v) for v in fields.get(k) or ()) for k in ("aliases", "distractors", "choices")}
    return Probe(id="", family="", task="", level=0, split="", prompt="", check=check, answer=fields["answer"], **lists)


def read_lines(lines: Iterable[str], source: str = "<workload>") -> list[WorkItem]:
    items: list[WorkItem] = []
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        where = f"{source}:{number}"
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        items.append(parse_line(raw, len(items), where))
    if not items:
        raise WorkloadError(f"{source}: no requests in the file")
    # Stable: equal offsets keep file order.
    return sorted(items, key=lambda item: item.at)


def read_workload(path: str | Path) -> list[WorkItem]:
    """All requests of a JSON-lines workload, sorted by `at`; raises WorkloadError on bad input."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"{path}: no such file")
    with path.open(encoding="utf-8") as fh:
        return read_lines(fh, str(path))


def write_workload(path: str | Path, records: Iterable[dict[str, Any]]) -> int:
    """Write records as JSON lines; returns how many."""
    count = 0
    with Path(path).open("w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count
