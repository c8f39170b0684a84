"""The learning component: the policy's templates, the pair store, and what was kept or skipped per template."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from edge_engine.adapters import AdapterLimits
from policies.artifact_dir import sha256_file
from policies.learn.admission import answer_text, input_reason
from policies.learn.config import LearnPolicy
from policies.learn.pairs import FILENAME, PairRow, PairStore, TemplatePairs
from policies.learn.templates import TemplateMatch, content_text
from policies.policy import Policy

if TYPE_CHECKING:
    from policies.learn.serving import LearnedServing

# The request fields a pair keeps besides its messages: what changes the answer, not how it travels.
_DROPPED_PARAMS = frozenset({"messages", "prompt", "model", "stream", "stream_options", "user", "metadata", "store",
                             "prompt_cache_key", "safety_identifier", "service_tier"})  # fmt: skip
COLLECTING = "collecting"  # the state of an enabled template; training and serving add theirs later
ARTIFACTS = "learn"  # STATE_DIR/learn: where `tierlane edge learn` writes adapters and the gateway finds them
STOPPED = "stopped"  # pairs kept from a template the policy no longer enables for that tenant/app


@dataclass(frozen=True, slots=True, kw_only=True)
class Answered:
    """What the gateway knows of one finished request the learner may keep."""

    pair_id: str
    tenant: str
    app: str
    body: Mapping[str, Any]  # the request as sent upstream
    messages: Sequence[Mapping[str, Any]]
    response: Mapping[str, Any] | None
    finish_reasons: Sequence[str]
    model: str
    input_tokens: int | None
    output_tokens: int | None


@dataclass(frozen=True, slots=True)
class TemplateStats:
    """One template's counters since start (for /metrics)."""

    tenant: str
    app: str
    template: str
    collected: int
    skipped: dict[str, int]
    stored: int


class Learning:
    """Matches finished requests to the templates of their tenant/app and keeps the answers worth teaching."""

    def __init__(self, policy: LearnPolicy, store: PairStore, *, wall: Any = time.time) -> None:
        self.policy = policy
        self.store = store
        self.serving: LearnedServing | None = None  # the adapters found on disk and their gates (None: not served)
        self._wall = wall
        # NOTE: changed on the event loop, read by /metrics scrapes that may run on another thread.
        self._lock = threading.Lock()
        self._collected: dict[tuple[str, str, str], int] = {}
        self._skipped: dict[tuple[str, str, str, str], int] = {}

    def skip(self, match: TemplateMatch, tenant: str, app: str, reason: str) -> None:
        """Count a matched request that was not kept, and why."""
        key = (tenant, app, match.template.name, reason)
        with self._lock:
            self._skipped[key] = self._skipped.get(key, 0) + 1

    def keep(self, match: TemplateMatch, done: Answered) -> str | None:
        """Queue the pair of a matched request answered by an upstream; None, or the reason it was not kept."""
        reason = input_reason(done.messages)
        text: str | None = None
        if reason is None:
            text, reason = answer_text(done.response, done.finish_reasons, done.body.get("response_format"))
        if reason is None:
            assert text is not None
            reason = self._queue(match, done, text)
        if reason is not None:
            self.skip(match, done.tenant, done.app, reason)
            return reason
        key = (done.tenant, done.app, match.template.name)
        with self._lock:
            self._collected[key] = self._collected.get(key, 0) + 1
        return None

    def _queue(self, match: TemplateMatch, done: Answered, text: str) -> str | None:
        learning = self.policy.for_app(done.tenant, done.app)
        # characters are at most the UTF-8 bytes: a request surely too large is refused before it is serialised
        if len(text) + sum(len(content_text(m.get("content"))) for m in done.messages) > learning.max_pair_bytes:
            return "too_large"
        template = match.template
        now = self._wall()
        row = PairRow(
            pair_id=done.pair_id, tenant=done.tenant, app=done.app, template=template.name,
            template_version=template.version, matched_by=match.via, ts=now, expires_at=now + template.retention_s,
            model=done.model, messages=orjson.dumps(list(done.messages)).decode(), variable=match.variable, answer=text,
            params=orjson.dumps({k: v for k, v in done.body.items() if k not in _DROPPED_PARAMS}).decode(),
            input_tokens=done.input_tokens, output_tokens=done.output_tokens, max_pairs=template.max_pairs,
            tenant_quota_bytes=learning.tenant_quota_bytes,
        )  # fmt: skip
        if row.bytes > learning.max_pair_bytes:
            return "too_large"
        return None if self.store.add(row) else "dropped"

    def stats(self) -> list[TemplateStats]:
        """Counters per template since start, and the pairs each holds now."""
        with self._lock:
            collected, skipped = dict(self._collected), dict(self._skipped)
        counts = self.store.counts
        keys = set(collected) | {k[:3] for k in skipped} | set(counts)
        by_key: dict[tuple[str, str, str], dict[str, int]] = {}
        for (tenant, app, name, reason), n in skipped.items():
            by_key.setdefault((tenant, app, name), {})[reason] = n
        return [TemplateStats(t, a, n, collected.get((t, a, n), 0), by_key.get((t, a, n), {}), counts.get((t, a, n), 0))
                for t, a, n in sorted(keys)]  # fmt: skip

    async def templates(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Every template with pairs or enabled for a tenant/app the policy names or the gateway has seen:
        its pairs, bytes and state: `collecting` while enabled without an adapter, then its adapter's gate
        (`shadow`, `serving`, `suspended`, with the figures under `learned`), `stopped` when only its pairs remain."""
        stored = {(p.tenant, p.app, p.template): p for p in await self.store.summary(tenant)}
        adapters = self.serving.keys if self.serving is not None else []
        enabled = {key for key in adapters if tenant is None or key[0] == tenant}
        for t, a in {*self.policy.named(), *self.policy.seen()}:
            if tenant is None or t == tenant:
                enabled.update((t, a, name) for name in self.policy.for_app(t, a).templates.by_name)
        out = []
        for key in sorted(set(stored) | enabled):
            found = stored.get(key) or TemplatePairs(*key, pairs=0, bytes=0, oldest=None, newest=None)
            template = self.policy.for_app(key[0], key[1]).templates.by_name.get(key[2])
            learned = self.serving.figures(key) if self.serving is not None and template is not None else None
            state = (learned["state"] if learned is not None else COLLECTING) if template is not None else STOPPED
            out.append({
                "tenant": key[0], "app": key[1], "template": key[2], "state": state, "learned": learned,
                "pairs": found.pairs, "bytes": found.bytes, "oldest": found.oldest, "newest": found.newest,
                "max_pairs": template.max_pairs if template is not None else None,
                "version": template.version if template is not None else None,
            })  # fmt: skip
        return out

    async def forget(self, template: str, tenant: str | None = None, app: str | None = None) -> int:
        return await self.store.forget(template, tenant, app)

    async def close(self) -> None:
        if self.serving is not None:
            await self.serving.close()
        await self.store.close()


async def open_learning(state_dir: Path, policy: Policy, *, base_model: Path | None = None, base_sha256: str | None = None,
                        adapters: AdapterLimits | None = None, artifacts_dir: Path | None = None,
                        rescan_s: float = 5.0) -> Learning:  # fmt: skip
    """The component: the learn section parsed, the pair file opened and swept; with `base_model` (the edge's
    GGUF), the learned adapters under `artifacts_dir` (default STATE_DIR/learn, where `tierlane edge learn`
    writes) served from it."""
    store = PairStore(state_dir / FILENAME)
    await store.open()
    learning = Learning(LearnPolicy(policy), store)
    if base_model is not None:
        from edge_engine.adapters import AdapterRunner
        from policies.learn.serving import LearnedServing

        sha: str = base_sha256 if base_sha256 is not None else await asyncio.to_thread(sha256_file, base_model)
        runner = await asyncio.to_thread(AdapterRunner, base_model, adapters or AdapterLimits())
        learning.serving = LearnedServing(learning.policy, artifacts_dir or state_dir / ARTIFACTS, runner, sha,
                                          rescan_s=rescan_s)  # fmt: skip
        await learning.serving.start()
    return learning
