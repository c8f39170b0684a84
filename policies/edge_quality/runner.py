"""Runs the edge engine over probes: greedy answers with per-token log-probabilities and entropies.

Requests are submitted together (at most `concurrency` in flight) so the engine batches them.
Each finished probe is appended to an optional JSON-lines cache keyed by the model file's hash,
so an interrupted run resumes where it stopped and a rerun with the same model costs nothing.
A run cut short by a full disk or a lost node can leave a partial line or NUL bytes: such lines
are dropped with a warning naming the file, which is rewritten without them (those probes run again).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edge_engine import EdgeEngine, EdgeSettings, Priority, SamplingParams
from policies.edge_quality.checkers import is_correct
from policies.edge_quality.probes import Probe

log = logging.getLogger(__name__)

MAX_TOKENS = 48


@dataclass(slots=True)
class EdgeRecord:
    """What the edge model did with one probe (one row of the calibration data)."""

    id: str
    family: str
    split: str
    text: str
    finish_reason: str
    completion_tokens: int
    prompt_tokens: int
    logprobs: list[float] = field(default_factory=list)  # one per released token
    entropies: list[float] = field(default_factory=list)
    correct: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> EdgeRecord:
        return cls(**row)


def sampling(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    """The decoding calibration measures: greedy, the engine's default loop stop, no low-confidence stop."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def engine_settings(model_path: str | Path | None, threads: int, slots: int = 8) -> EdgeSettings:
    """Engine defaults (as the gateway runs them) but a queue that waits as long as the run takes."""
    return EdgeSettings(
        model_path=str(model_path) if model_path else None,
        n_threads=threads,
        slots=slots,
        n_ctx=1024,
        max_queue=max(64, slots),
        max_queue_wait_s=3600.0,
    )


async def answer_one(
    engine: EdgeEngine, probe: Probe, params: SamplingParams, priority: Priority = Priority.INTERACTIVE
) -> EdgeRecord:
    generation = await engine.submit(messages=probe.messages, params=params, priority=priority)
    text: list[str] = []
    logprobs: list[float] = []
    entropies: list[float] = []
    finish = "stop"
    completion = prompt_tokens = 0
    async for event in generation:
        text.append(event.text)
        for info in event.tokens:
            logprobs.append(round(float(info.logprob), 5))
            entropies.append(round(float(info.entropy), 5))
        if event.finish_reason is not None:
            finish, completion, prompt_tokens = event.finish_reason, event.completion_tokens, event.prompt_tokens
    answer = "".join(text)
    logprobs = [v if math.isfinite(v) else -50.0 for v in logprobs]
    return EdgeRecord(
        id=probe.id, family=probe.family, split=probe.split, text=answer, finish_reason=finish,
        completion_tokens=completion, prompt_tokens=prompt_tokens, logprobs=logprobs, entropies=entropies,
        correct=is_correct(probe, answer, finish),
    )


async def run_probes(
    probes: Sequence[Probe],
    *,
    model_path: str | Path | None = None,
    model_sha256: str = "",
    threads: int = 1,
    concurrency: int = 8,
    max_tokens: int = MAX_TOKENS,
    cache: Path | None = None,
    progress: Callable[[int], None] | None = None,
    engine: EdgeEngine | None = None,
    deadline: float | None = None,
) -> list[EdgeRecord]:
    """Records in probe order; probes already in `cache` for this model and prompt are not rerun.

    The checker verdict is recomputed from the cached text, so a checker fix needs no rerun.
    `engine`: a started engine to use (left running); None: one is started for the run and closed.
    `deadline` (time.monotonic()): no probe starts after it; the answered ones are returned, in
    probe order, and probes then start in the given order (not longest first), so that a run cut
    short holds the probes that came first.
    """
    key_of = {p.id: f"{model_sha256}|{max_tokens}|{p.prompt}" for p in probes}
    cached: dict[str, EdgeRecord] = {}
    if cache is not None:
        rows = await asyncio.to_thread(_read_all, cache)
        for p in probes:
            row = rows.get(key_of[p.id])
            if row is not None:
                rec = EdgeRecord.from_json(row)
                rec.correct = is_correct(p, rec.text, rec.finish_reason)
                cached[p.id] = rec
    todo = [p for p in probes if p.id not in cached]
    if progress is not None and cached:
        progress(len(cached))
    results: dict[str, EdgeRecord] = dict(cached)
    if todo:
        params = sampling(max_tokens)
        own = engine is None
        if engine is None:
            engine = EdgeEngine(engine_settings(model_path, threads, slots=concurrency))
            await engine.start()
        running = engine
        sem = asyncio.Semaphore(concurrency)
        lock = asyncio.Lock()
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
        fh = cache.open("a", encoding="utf-8") if cache is not None else None

        async def one(p: Probe) -> None:
            async with sem:
                if deadline is not None and time.monotonic() >= deadline:
                    return  # the time budget is spent: this probe is not run
                # on a serving engine the probes queue behind the requests it serves
                rec = await answer_one(running, p, params, Priority.INTERACTIVE if own else Priority.BATCH)
            results[p.id] = rec
            async with lock:
                if fh is not None:
                    fh.write(json.dumps({"key": key_of[p.id], **rec.to_json()}, ensure_ascii=False) + "\n")
                    fh.flush()
            if progress is not None:
                progress(1)

        try:
            # longest prompts first: they are the ones that would otherwise finish last alone
            order = todo if deadline is not None else sorted(todo, key=lambda q: -len(q.prompt))
            await asyncio.gather(*(one(p) for p in order))
        finally:
            if fh is not None:
                fh.close()
            if own:
                await running.close()
    return [results[p.id] for p in probes if p.id in results]


def _read_all(path: Path) -> dict[str, dict[str, Any]]:
    """The cached rows by key; damaged lines are dropped and the file rewritten without them."""
    out: dict[str, dict[str, Any]] = {}
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return out
    good: list[bytes] = []
    damaged: list[int] = []
    for number, raw in enumerate(data.split(b"\n"), 1):
        # NOTE: a file system that lost a write can show NUL bytes where it was, before a later append
        line = raw.strip(b"\0 \t\r")
        if not raw.strip():
            continue
        try:
            row = json.loads(line)
            key = str(row.pop("key"))
            EdgeRecord.from_json(dict(row))  # a row of another shape would fail later, far from its file
        except (ValueError, TypeError, KeyError, AttributeError):
            damaged.append(number)
            continue
        out[key] = row
        good.append(line)
    clean = b"".join(line + b"\n" for line in good)
    if clean != data:
        if damaged:
            log.warning("probe cache %s: dropped %d damaged line(s) (line %s of %d; a run cut short, e.g. a full disk "
                        "or a lost node); %d cached answers kept, those probes run again",
                        path, len(damaged), ", ".join(map(str, damaged[:5])) + (" ..." if len(damaged) > 5 else ""),
                        data.count(b"\n") + (not data.endswith(b"\n")), len(out))
        _rewrite(path, clean)
    return out


def _rewrite(path: Path, data: bytes) -> None:
    """The cache as `data`, replaced at once: the next append starts on a line of its own."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        log.warning("probe cache %s could not be rewritten without its damaged lines: %s", path, exc)
