"""Shadow quality hook: compare sampled cache and edge answers with what the upstream pool says.

For a sampled request that the cache or the edge lane answered in full, the same request is
sent to the upstream pool in the background (never on the response path, bounded in
concurrency, failures logged), both answers are embedded with the gateway's sentence
embedder, and their cosine similarity is stored per lane in `<state_dir>/shadow.sqlite3`.
GET /v1/shadow (gateway.routes.shadow) reads the table back.

With `cache.max_error_rate` set for the request's tenant/app, a served *semantic* cache hit (not
an exact repeat) is sampled at `cache.error_sample_rate` instead (whatever `shadow.sample_rate`
and `shadow.lanes` say; `shadow.enabled: false` turns it off too), and its judgement goes to the
cache's error bound (policies/cache/error_bound.py): the served answer was right when it agrees
with the upstream's: equal final results where both have one (a number, a choice letter, a JSON
document: policies/router/agreement.py; "42" and "43" are 0.84 similar), else answer similarity >= AGREE
(the check the table's share counts). The
request's own checks (rule vetoes, verifier) compare requests, not answers, so they have no say
here. Each such re-ask is an upstream call, metered by the upstream as any other.

Judging is bounded and billed (`shadow` section): every upstream re-ask (the routing quality
bound's, the cache error bound's and the plain lane samples) counts against one gateway-wide
`max_per_minute` and `max_pending`, of which one tenant takes at most `tenant_share` while another
tenant's requests were judged within the last minute (a lone tenant may use it all, like the
edge's `tenant_slot_share`). A prompt over `max_prompt_tokens` is not re-asked (skipped, reason
`prompt_tokens`; never truncated, which would change the question). Each re-ask is held against
the payer's budgets and written to the ledger as operation `judge` (`bill_judging_to`: the
`operator_account` line by default, the judged tenant's with `tenant`; the judged request's
tenant and app are kept in `judged_tenant`/`judged_app`), so /v1/usage and the budgets show it,
across restarts. Skips are counted per reason in `ShadowHook.skipped`.

A miss whose best candidate passed every check but the bound's threshold (the lookup leaves it
in `ctx.cache_candidate`) is sampled at the same rate once the upstream has answered it: the
stored answer is compared with the upstream's (no second upstream call), and the judgement goes
to the bound as an observation below its threshold (what lets it loosen on evidence).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import secrets
import sqlite3
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.apis.native import MESSAGES
from gateway.context import Outcome, RequestContext
from gateway.lanes import AUTO
from gateway.pipeline.cache_lookup import bound_scope
from gateway.route_quality import QualityProbe
from policies.cache.error_bound import BoundParams
from policies.domain import Usage
from policies.learn.admission import answer_text as kept_answer
from policies.pricing import Pricing
from policies.router.agreement import judge, judge_calls
from telemetry.tokens import estimate_request_tokens

if TYPE_CHECKING:
    from gateway.services import Services

log = logging.getLogger(__name__)

FILENAME = "shadow.sqlite3"
PATHS = {"chat": "/chat/completions", "completions": "/completions"}
SCHEMA = """
CREATE TABLE IF NOT EXISTS shadow (
    ts REAL NOT NULL,
    request_id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    app TEXT NOT NULL,
    lane TEXT NOT NULL,
    model TEXT NOT NULL,
    similarity REAL NOT NULL,
    upstream_input_tokens INTEGER NOT NULL,
    upstream_output_tokens INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS shadow_ts ON shadow (ts);
"""
AGREE = 0.8  # the similarity above which two answers are counted as agreeing
# How long shutdown waits for shadow calls in flight before cancelling them; each is already
# bounded by the upstream's own timeouts, this only keeps a slow one from holding up a stop.
CLOSE_GRACE_S = 10.0
WINDOW_S = 60.0  # the per-minute cap's window, and how long a tenant counts as active for the shares
PRUNE_EVERY = 500  # the shadow table is pruned on the first insert and then every this many
BILL_TO = ("operator", "tenant")


@dataclass(slots=True, frozen=True)
class ShadowConfig:
    """The `shadow` policy section."""

    enabled: bool = True
    sample_rate: float = 0.0
    lanes: tuple[str, ...] = ("cache", "edge")
    pool: str | None = None
    model: str | None = None
    max_concurrency: int = 2
    max_pending: int = 32
    seed: int | None = None
    max_tokens: int = 1024  # the most completion tokens one shadow call asks for (the client's ask may be 60,000)
    max_per_minute: int = 120  # upstream re-asks (judging) in any minute, gateway-wide, at most
    tenant_share: float = 0.5  # of max_per_minute and max_pending, the most one tenant takes while others are judged
    max_prompt_tokens: int = 8192  # prompts estimated over this are not re-asked (skipped, never truncated)
    bill_judging_to: str = "operator"  # whose ledger line and budgets a re-ask's cost goes to: operator | tenant
    operator_account: str = "_operator"  # the tenant name of the operator's own line
    max_rows: int = 200_000  # the shadow table keeps the newest this many rows
    max_age_days: float = 30.0  # and none older than this

    @classmethod
    def from_section(cls, section: dict[str, Any]) -> ShadowConfig:
        rate = float(section.get("sample_rate", 0.0) or 0.0)
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"shadow.sample_rate must be within 0..1, got {rate}")
        concurrency = int(section.get("max_concurrency", 2))
        if concurrency < 1:
            raise ValueError("shadow.max_concurrency must be at least 1")
        return cls(
            enabled=bool(section.get("enabled", True)),
            sample_rate=rate,
            lanes=tuple(section.get("lanes") or ("cache", "edge")),
            pool=section.get("pool"),
            model=section.get("model"),
            max_concurrency=concurrency,
            max_pending=max(concurrency, int(section.get("max_pending", 32))),
            seed=section.get("seed"),
            max_tokens=max(1, int(section.get("max_tokens", 1024))),
            max_per_minute=max(0, int(section.get("max_per_minute", 120))),
            tenant_share=_share(section.get("tenant_share", 0.5)),
            max_prompt_tokens=max(1, int(section.get("max_prompt_tokens", 8192))),
            bill_judging_to=_bill_to(section.get("bill_judging_to", "operator")),
            operator_account=str(section.get("operator_account") or "_operator"),
            max_rows=max(1, int(section.get("max_rows", 200_000))),
            max_age_days=max(0.0, float(section.get("max_age_days", 30.0))),
        )


def _share(value: Any) -> float:
    share = float(value)
    if not 0.0 < share <= 1.0:
        raise ValueError(f"shadow.tenant_share must be within (0, 1], got {share}")
    return share


def _bill_to(value: Any) -> str:
    if value not in BILL_TO:
        raise ValueError(f"shadow.bill_judging_to must be one of {', '.join(BILL_TO)}, got {value!r}")
    return str(value)


@dataclass(slots=True, frozen=True)
class ShadowRow:
    ts: float
    request_id: str
    tenant: str
    app: str
    lane: str
    model: str
    similarity: float
    upstream_input_tokens: int = 0
    upstream_output_tokens: int = 0


def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.executescript(SCHEMA)
    return conn


class ShadowStore:
    """Appends shadow results to SQLite off the event loop, pruned by age and row count (on the first
    insert and every `prune_every` after it, on the same thread)."""

    def __init__(
        self,
        path: Path,
        *,
        max_rows: int = 200_000,
        max_age_s: float = 30 * 86400.0,
        prune_every: int = PRUNE_EVERY,
        wall: Any = time.time,
    ) -> None:
        self.path = path
        self.max_rows = max_rows
        self.max_age_s = max_age_s
        self.prune_every = max(1, prune_every)
        self._wall = wall
        self._since_prune = 0
        self.pruned = 0  # rows deleted by pruning
        # NOTE: a single worker thread owns the connection, so writes never run concurrently.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shadow-store")
        self._conn: sqlite3.Connection | None = None
        self._closed = False

    def _insert(self, row: ShadowRow) -> None:
        if self._conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = connect(self.path)
        with self._conn:
            self._conn.execute(
                "INSERT INTO shadow VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (row.ts, row.request_id, row.tenant, row.app, row.lane, row.model, row.similarity,
                 row.upstream_input_tokens, row.upstream_output_tokens),
            )
        if self._since_prune % self.prune_every == 0:
            self._prune()
        self._since_prune += 1

    def _prune(self) -> None:
        """Delete the rows older than `max_age_s`, then all but the newest `max_rows` (writer thread)."""
        assert self._conn is not None
        with self._conn:
            deleted = 0
            if self.max_age_s > 0:
                deleted += self._conn.execute("DELETE FROM shadow WHERE ts < ?", (self._wall() - self.max_age_s,)).rowcount
            deleted += self._conn.execute(
                "DELETE FROM shadow WHERE rowid IN (SELECT rowid FROM shadow ORDER BY ts DESC LIMIT -1 OFFSET ?)",
                (self.max_rows,),
            ).rowcount
        self.pruned += max(0, deleted)

    async def add(self, row: ShadowRow) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, self._insert, row)

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    async def close(self) -> None:
        """Close the connection on the thread that owns it (after the writes queued before), then stop it."""
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(self._executor, self._disconnect)
        self._executor.shutdown(wait=True)


def summarize(path: Path, since: float = 0.0) -> list[dict[str, Any]]:
    """Per lane since `since` (unix seconds): count, mean, p10, share above 0.8, upstream tokens. Blocking."""
    if not path.exists():
        return []
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT lane, similarity, upstream_input_tokens, upstream_output_tokens FROM shadow WHERE ts >= ?",
            (since,),
        ).fetchall()
    finally:
        conn.close()
    by_lane: dict[str, list[tuple[float, int, int]]] = {}
    for lane, similarity, tin, tout in rows:
        by_lane.setdefault(lane, []).append((float(similarity), int(tin), int(tout)))
    out = []
    for lane, values in sorted(by_lane.items()):
        sims = np.array([v[0] for v in values], dtype=np.float64)
        out.append({
            "lane": lane,
            "count": int(sims.size),
            "mean": round(float(sims.mean()), 4),
            "p10": round(float(np.percentile(sims, 10)), 4),
            "share_above_0_8": round(float((sims > AGREE).mean()), 4),
            "upstream_input_tokens": sum(v[1] for v in values),
            "upstream_output_tokens": sum(v[2] for v in values),
        })
    return out


def shadow_body(ctx: RequestContext, config: ShadowConfig, model: str | None) -> dict[str, Any]:
    """The request as a shadow call sends it: not streamed, to `model`, at most `config.max_tokens` out."""
    body = {k: v for k, v in ctx.body.items() if k not in ("stream", "stream_options", "max_tokens", "max_completion_tokens")}
    body["model"] = model
    asked = ctx.request.output_limit if ctx.request is not None else ctx.body.get("max_tokens")
    asked = asked if isinstance(asked, int) and asked > 0 else None
    body["max_tokens"] = min(asked or config.max_tokens, config.max_tokens)  # bounded spend per call
    return body


def disagree(ours: str, theirs: str, similarity: float) -> bool:
    """Whether two answers disagree: by their final results where both have one (numbers, choice
    letters, JSON: policies/router/agreement.py), else by answer similarity below AGREE."""
    verdict = judge(ours, theirs)
    return similarity < AGREE if verdict is None else verdict == "disagree"


def answer_calls(response: dict[str, Any] | None) -> list[Any]:
    """The first choice's tool calls of a chat answer ([] when there are none)."""
    if not isinstance(response, dict):
        return []
    choices = response.get("choices") or []
    message = choices[0].get("message") if choices and isinstance(choices[0], dict) else None
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    return calls if isinstance(calls, list) else []


def answer_text(response: dict[str, Any] | None) -> str:
    """The first choice's text of a chat or completions answer ('' when there is none)."""
    if not isinstance(response, dict):
        return ""
    choices = response.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    first = choices[0]
    message = first.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content.strip()
    text = first.get("text")
    return text.strip() if isinstance(text, str) else ""


class ShadowHook:
    """Samples finished cache/edge answers and compares them with the upstream's in the background."""

    name = "shadow"

    def __init__(
        self, services: Services, config: ShadowConfig, store: ShadowStore, *, clock: Any = time.monotonic
    ) -> None:
        self.services = services
        self.config = config
        self.store = store
        self._rng = random.Random(config.seed)
        self._gate = asyncio.Semaphore(config.max_concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        # Per (tenant, app, model), resolved once: the policy does not change while it is in use.
        self._overrides = bool(services.policy.section("shadow").get("overrides"))
        self._configs: dict[tuple[str, str, str], ShadowConfig] = {}
        self.sampled = 0
        self.dropped = 0
        self.failed = 0
        self.recorded = 0
        self.judged = 0  # semantic cache hits judged for the cache's error bound
        self.judged_refused = 0  # candidates the bound refused, judged against the upstream's answer
        self.tier_judged = 0  # tiered answers judged against the other tier's (lanes.upstream.tiers.max_quality_loss)
        self.learned_judged = 0  # learned templates' served answers judged against the upstream's
        self.tier_skipped = 0  # tier re-asks skipped: over shadow.max_per_minute or the tenant's share of it
        self.skipped: dict[str, int] = {}  # judgements not made, per reason (see `_admit`)
        self.spent_usd = 0.0  # what the re-asks cost (also in the ledger, operation `judge`)
        self._clock = clock
        self._asks: deque[tuple[float, str]] = deque()  # (time, tenant) of the last minute's upstream re-asks
        self._asked: dict[str, int] = {}  # of those, per tenant
        self._seen: dict[str, float] = {}  # tenant -> when it last had a judgement wanted
        self._pending: dict[str, int] = {}  # tasks waiting or running, per tenant
        # budget holds are keyed like requests; unique across replicas (a shared store sees them all)
        self._key_prefix = f"judge-{secrets.token_hex(6)}-"
        self._keys = itertools.count()
        self._pricing: Pricing | None = None

    def _skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        if reason == "queue_full" or reason == "tenant_queue":
            self.dropped += 1

    def _admit(self, ctx: RequestContext, config: ShadowConfig, *, reask: bool) -> bool:
        """Whether a judgement of `ctx` may be queued now; a refusal is counted under its reason.

        Gateway-wide: at most `max_pending` queued and `max_per_minute` upstream re-asks (`reask`)
        in any minute. While another tenant had a judgement wanted within the minute, one tenant
        takes at most `tenant_share` of each (at least one), so a flood of one tenant's requests
        leaves the rest to the others; a tenant alone may use it all.
        """
        tenant, now = ctx.principal.tenant, self._clock()
        while self._asks and now - self._asks[0][0] >= WINDOW_S:
            _, old = self._asks.popleft()
            left = self._asked[old] - 1
            if left:
                self._asked[old] = left
            else:
                del self._asked[old]
        self._seen[tenant] = now
        if len(self._seen) > 1024:  # bounded: forget the tenants not seen within the window
            self._seen = {t: at for t, at in self._seen.items() if now - at < WINDOW_S}
        shared = any(t != tenant and now - at < WINDOW_S for t, at in self._seen.items()) or any(
            t != tenant for t in self._pending
        )
        if reask and len(self._asks) >= config.max_per_minute:
            self._skip("per_minute")
            return False
        if reask and shared and self._asked.get(tenant, 0) >= max(1, math.floor(config.max_per_minute * config.tenant_share)):
            self._skip("tenant_per_minute")
            return False
        if len(self._tasks) >= config.max_pending:
            self._skip("queue_full")
            return False
        if shared and self._pending.get(tenant, 0) >= max(1, math.floor(config.max_pending * config.tenant_share)):
            self._skip("tenant_queue")
            return False
        if reask and estimate_request_tokens(ctx.body) > config.max_prompt_tokens:
            self._skip("prompt_tokens")
            return False
        if reask:
            self._asks.append((now, tenant))
            self._asked[tenant] = self._asked.get(tenant, 0) + 1
        return True

    def _spawn(self, ctx: RequestContext, work: Any) -> None:
        tenant = ctx.principal.tenant
        self._pending[tenant] = self._pending.get(tenant, 0) + 1
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)

        def done(finished: asyncio.Task[None]) -> None:
            self._tasks.discard(finished)
            left = self._pending.get(tenant, 1) - 1
            if left > 0:
                self._pending[tenant] = left
            else:
                self._pending.pop(tenant, None)

        task.add_done_callback(done)

    async def _reask(self, ctx: RequestContext, config: ShadowConfig, key: str, pool_name: str, model: str,
                     body: dict[str, Any]) -> tuple[Any, int, int, float]:
        """Ask `model` on `pool_name` the request again, billed as a judging row either way (a send that
        fails: status 502, cost 0); (reply, input tokens, output tokens, cost)."""
        started = time.perf_counter()
        try:
            reply = await self.services.pool.send(
                pool_name, PATHS[ctx.operation], body, headers={}, model=model, stream=False,
                client_authorization=ctx.headers.get("Authorization"), priority="batch",  # judging waits for idle capacity
            )
        except BaseException:
            await self._bill(ctx, config, key, model=model, lane="judge", tokens_in=0, tokens_out=0,
                             cost=0.0, status=502, started=started)  # fmt: skip
            raise
        if reply.api == "messages" and not reply.native and reply.status == 200 and isinstance(reply.body, dict):
            # a member without chat answered in Messages' shape: judged and billed as the chat answer it stands for
            translated = MESSAGES.usage(reply.body.get("usage"))
            reply.body = {**MESSAGES.chat(reply.body), "usage": translated.to_openai() if translated else {}}
        usage = (reply.body.get("usage") if isinstance(reply.body, dict) else None) or {}
        tokens_in, tokens_out = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        spent = self._price(model, pool_name, tokens_in, tokens_out)
        await self._bill(ctx, config, key, model=model, lane="judge", tokens_in=tokens_in, tokens_out=tokens_out,
                         cost=spent, status=reply.status, started=started)  # fmt: skip
        return reply, tokens_in, tokens_out, spent

    def _price(self, model: str, pool: str, tokens_in: int, tokens_out: int) -> float:
        if self._pricing is None:
            self._pricing = Pricing.from_policy(self.services.policy)
        return self._pricing.upstream(model, pool).cost(Usage(input_tokens=tokens_in, output_tokens=tokens_out))

    def _payer(self, ctx: RequestContext, config: ShadowConfig) -> tuple[str, str]:
        """(tenant, app) whose ledger line and budgets a re-ask of `ctx` is billed to: the operator's
        own line (its app names the judged tenant) or the judged request's tenant and app."""
        if config.bill_judging_to == "tenant":
            return ctx.principal.tenant, ctx.principal.app
        return config.operator_account, ctx.principal.tenant

    async def _hold(self, ctx: RequestContext, config: ShadowConfig, key: str) -> bool:
        """Hold the re-ask against the payer's budgets; False (skipped, reason `budget`) when over a limit."""
        telemetry = self.services.telemetry
        if telemetry is None:
            return True
        tenant, app = self._payer(ctx, config)
        if await telemetry.admit_judge(key, tenant, app, estimate_request_tokens(ctx.body)):
            return True
        self._skip("budget")
        return False

    async def _bill(
        self, ctx: RequestContext, config: ShadowConfig, key: str, *, model: str, lane: str,
        tokens_in: int, tokens_out: int, cost: float, status: int, started: float,
    ) -> None:  # fmt: skip
        """Settle the re-ask's hold and write its ledger row (operation `judge`)."""
        self.spent_usd += cost
        telemetry = self.services.telemetry
        if telemetry is None:
            return
        tenant, app = self._payer(ctx, config)
        await telemetry.record_judge(
            key, request_id=ctx.request_id, tenant=tenant, app=app, judged_tenant=ctx.principal.tenant,
            judged_app=ctx.principal.app, lane=lane, model=model, input_tokens=tokens_in, output_tokens=tokens_out,
            cost=cost, status=status, latency_s=time.perf_counter() - started,
        )  # fmt: skip

    def _bound(self, ctx: RequestContext) -> tuple[str, BoundParams, int, float] | None:
        """(scope, bound, entry id, score) when this answer is a semantic cache hit under `cache.max_error_rate`."""
        cache = self.services.cache
        if cache is None or ctx.lane != "cache" or ctx.attributes.get("tierlane.cache.exact") is not False:
            return None
        entry_id, score = ctx.attributes.get("tierlane.cache.entry_id"), ctx.attributes.get("tierlane.cache.score")
        if not isinstance(entry_id, int) or not isinstance(score, float):
            return None
        config = cache.config_for(tenant=ctx.principal.tenant, app=ctx.principal.app, model=ctx.model,
                                  route=ctx.requested_route)  # fmt: skip
        if config.bound is None:
            return None
        return bound_scope(ctx.principal.tenant, ctx.principal.app), config.bound, entry_id, score

    def _config_for(self, ctx: RequestContext) -> ShadowConfig:
        if not self._overrides:
            return self.config
        key = (ctx.principal.tenant, ctx.principal.app, ctx.model)
        config = self._configs.get(key)
        if config is None:
            if len(self._configs) >= 4096:  # bounded: model names come from clients
                self._configs.clear()
            section = self.services.policy.resolve("shadow", tenant=key[0], app=key[1], model=key[2])
            config = self._configs[key] = ShadowConfig.from_section(section)
        return config

    def _candidate(self, ctx: RequestContext) -> tuple[str, BoundParams, int, float, str] | None:
        """(scope, bound, entry id, score, stored answer) of the candidate the error bound alone refused,
        on a request the upstream answered (cache.max_error_rate)."""
        cache, candidate = self.services.cache, ctx.cache_candidate
        if cache is None or candidate is None or ctx.lane != "upstream" or candidate.score is None:
            return None
        config = cache.config_for(tenant=ctx.principal.tenant, app=ctx.principal.app, model=ctx.model,
                                  route=ctx.requested_route)  # fmt: skip
        stored = answer_text(candidate.response)
        if config.bound is None or not stored:
            return None
        return bound_scope(ctx.principal.tenant, ctx.principal.app), config.bound, candidate.entry_id, candidate.score, stored

    async def on_complete(self, ctx: RequestContext, outcome: Outcome) -> None:
        if self._closed or ctx.operation not in PATHS or not outcome.complete or outcome.status != 200:
            return
        config = self._config_for(ctx)
        learned = ctx.learned
        if learned is not None and learned.recheck and learned.served is not None and ctx.lane == "edge":
            if config.enabled and self._admit(ctx, config, reask=True):
                self._spawn(ctx, self._recheck_learned(ctx, config, learned))
            return
        probe = ctx.quality_probe
        if probe is not None and config.enabled and ctx.lane == "upstream" and ctx.tier in probe.targets:
            self._judge_tier_soon(ctx, config, probe, answer_text(outcome.response), answer_calls(outcome.response))
        candidate = self._candidate(ctx)
        if candidate is not None and config.enabled and self.services.embedder is not None:
            self._judge_soon(ctx, candidate, answer_text(outcome.response))
        bound = self._bound(ctx)
        if bound is not None:
            rate = bound[1].sample_rate
        elif ctx.lane in config.lanes:
            rate = config.sample_rate
        else:
            return
        if not config.enabled or rate <= 0.0:
            return
        if self.services.embedder is None or not self.services.pool.has_upstreams():
            return
        if self._rng.random() >= rate:
            return
        text = answer_text(outcome.response)
        if not text or not self._admit(ctx, config, reask=True):
            return
        self.sampled += 1
        self._spawn(ctx, self._shadow(ctx, config, text, bound))

    def _target(self, ctx: RequestContext, config: ShadowConfig) -> tuple[str, str]:
        """The pool and model a shadow call asks: the policy's, else the model that answered (a cache
        hit's stored answer names it), never `auto` or a name no upstream serves."""
        pool = self.services.pool
        names = pool.pool_names()
        wanted = config.pool or self.services.policy.section("lanes").get("upstream", {}).get("pool")
        model = config.model or ctx.model
        if pool.pool_for_model(model) is None or model == AUTO:
            answered = ctx.target_model
            if answered and answered != AUTO and pool.pool_for_model(answered) is not None:
                model = answered
            else:
                fallback = wanted if wanted in names else names[0]
                model = pool.default_model(fallback) or model
        name = wanted if wanted in names else pool.pool_for_model(model) or names[0]
        return name, model

    async def _shadow(
        self, ctx: RequestContext, config: ShadowConfig, text: str, bound: tuple[str, BoundParams, int, float] | None
    ) -> None:
        key = f"{self._key_prefix}{next(self._keys)}"
        try:
            async with self._gate:
                pool_name, model = self._target(ctx, config)
                body = shadow_body(ctx, config, model)
                if not await self._hold(ctx, config, key):
                    return
                reply, _, _, _ = await self._reask(ctx, config, key, pool_name, model, body)
                if reply.status != 200:
                    raise RuntimeError(f"the upstream answered {reply.status}")
                upstream_text = answer_text(reply.body)
                if not upstream_text:
                    raise RuntimeError("the upstream answer has no text")
                embedder = self.services.embedder
                if embedder is None:
                    return
                ours, theirs = await asyncio.gather(embedder.embed(text), embedder.embed(upstream_text))
                usage = reply.body.get("usage") or {}
            similarity = float(np.clip(np.dot(np.asarray(ours), np.asarray(theirs)), -1.0, 1.0))
            await self.store.add(ShadowRow(
                ts=time.time(), request_id=ctx.request_id, tenant=ctx.principal.tenant, app=ctx.principal.app,
                lane=ctx.lane, model=ctx.target_model or ctx.model, similarity=similarity,
                upstream_input_tokens=int(usage.get("prompt_tokens") or 0),
                upstream_output_tokens=int(usage.get("completion_tokens") or 0),
            ))
            self.recorded += 1
            if bound is not None and self.services.cache is not None:
                scope, params, entry_id, score = bound
                await self.services.cache.observe(scope, params, entry_id, score, wrong=disagree(text, upstream_text, similarity))
                self.judged += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a shadow call must never surface to anyone
            self.failed += 1
            log.warning("shadow comparison for request %s (%s lane) failed: %s", ctx.request_id, ctx.lane, exc)

    def _judge_soon(self, ctx: RequestContext, candidate: tuple[str, BoundParams, int, float, str], upstream_text: str) -> None:
        """Sample the refused candidate for judgement: no upstream call, the upstream already answered."""
        if not upstream_text or self._rng.random() >= candidate[1].sample_rate:
            return
        if not self._admit(ctx, self._config_for(ctx), reask=False):
            return
        self._spawn(ctx, self._judge(ctx, candidate, upstream_text))

    async def _judge(self, ctx: RequestContext, candidate: tuple[str, BoundParams, int, float, str], upstream_text: str) -> None:
        scope, params, entry_id, score, stored = candidate
        try:
            async with self._gate:
                embedder, cache = self.services.embedder, self.services.cache
                if embedder is None or cache is None:
                    return
                ours, theirs = await asyncio.gather(embedder.embed(stored), embedder.embed(upstream_text))
            similarity = float(np.clip(np.dot(np.asarray(ours), np.asarray(theirs)), -1.0, 1.0))
            await cache.observe(scope, params, entry_id, score, wrong=disagree(stored, upstream_text, similarity))
            self.judged_refused += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a judgement must never surface to anyone
            self.failed += 1
            log.warning("judging the refused cache candidate of request %s failed: %s", ctx.request_id, exc)

    async def _recheck_learned(self, ctx: RequestContext, config: ShadowConfig, learned: Any) -> None:
        """A learned template's served answer re-asked upstream and judged: the template's bound held online."""
        learn = self.services.learn
        serving = learn.serving if learn is not None else None
        key = f"{self._key_prefix}{next(self._keys)}"
        try:
            async with self._gate:
                if serving is None:
                    return
                pool_name, model = self._target(ctx, config)
                if not await self._hold(ctx, config, key):
                    return
                reply, _, _, _ = await self._reask(ctx, config, key, pool_name, model, shadow_body(ctx, config, model))
                if reply.status != 200:
                    raise RuntimeError(f"the upstream answered {reply.status}")
            body = reply.body if isinstance(reply.body, dict) else None
            text, reason = kept_answer(body, [], ctx.body.get("response_format"))
            if text is None:
                raise RuntimeError(f"the upstream's answer cannot judge it ({reason})")
            serving.recheck(learned.choice, learned.served, text)
            self.learned_judged += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a judgement must never surface to anyone
            self.failed += 1
            log.warning("re-asking the upstream for learned template answer %s failed: %s", ctx.request_id, exc)

    def _judge_tier_soon(self, ctx: RequestContext, config: ShadowConfig, probe: QualityProbe, text: str,
                         calls: list[Any] | None = None) -> None:
        """Sample a tiered answer for the routing quality bound: the other tier is asked the same request.
        An answer that calls tools is judged by its calls (an agent's turns mostly are)."""
        if not (text or calls) or self.services.route_quality is None or self._rng.random() >= probe.params.sample_rate:
            return
        before = sum(self.skipped.get(r, 0) for r in ("per_minute", "tenant_per_minute"))
        if not self._admit(ctx, config, reask=True):
            if sum(self.skipped.get(r, 0) for r in ("per_minute", "tenant_per_minute")) > before:
                self.tier_skipped += 1
            return
        self._spawn(ctx, self._judge_tier(ctx, config, probe, text, calls or []))

    async def _judge_tier(self, ctx: RequestContext, config: ShadowConfig, probe: QualityProbe, text: str,
                          calls: list[Any] | None = None) -> None:
        quality = self.services.route_quality
        assert quality is not None and ctx.tier is not None
        other = "strong" if ctx.tier == "cost" else "cost"
        pool_name, model = probe.targets[other]
        spent = 0.0
        key = f"{self._key_prefix}{next(self._keys)}"
        try:
            async with self._gate:
                if pool_name is None or model is None:
                    raise RuntimeError(f"the {other} tier has no upstream pool or model")
                if not await self._hold(ctx, config, key):
                    return
                reply, tokens_in, tokens_out, spent = await self._reask(ctx, config, key, pool_name, model,
                                                                        shadow_body(ctx, config, model))
                if reply.status != 200:
                    raise RuntimeError(f"the {other} tier answered {reply.status}")
                theirs = answer_text(reply.body)
                # tool calls first: same tools, arguments equal as values (policies/router/agreement.py)
                verdict = judge_calls(calls or [], answer_calls(reply.body))
                by_calls = verdict is not None
                if not by_calls:
                    if not theirs:
                        raise RuntimeError(f"the {other} tier's answer has no text")
                    verdict = judge(text, theirs)
                similarity = 1.0 if verdict == "agree" else 0.0
                if not by_calls and (verdict is None or self.services.embedder is not None):
                    embedder = self.services.embedder
                    if embedder is None:
                        raise RuntimeError("free-text answers need the embedder to be judged")
                    a, b = await asyncio.gather(embedder.embed(text), embedder.embed(theirs))
                    similarity = float(np.clip(np.dot(np.asarray(a), np.asarray(b)), -1.0, 1.0))
            wrong = similarity < AGREE if verdict is None else verdict == "disagree"
            await quality.record(probe, disagree=wrong)
            quality.bounds.judge_spend(probe.scope, probe.region, probe.params, spent)
            self.tier_judged += 1
            await self.store.add(ShadowRow(
                ts=time.time(), request_id=ctx.request_id, tenant=ctx.principal.tenant, app=ctx.principal.app,
                lane=f"tier_{ctx.tier}", model=model or "", similarity=similarity,
                upstream_input_tokens=tokens_in, upstream_output_tokens=tokens_out,
            ))  # fmt: skip
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a judgement must never surface to anyone; it is counted, never "agree"
            self.failed += 1
            quality.bounds.judge_spend(probe.scope, probe.region, probe.params, spent, failed=True)
            log.warning("judging the %s tier's answer of request %s against the %s tier failed: %s",
                        ctx.tier, ctx.request_id, other, exc)  # fmt: skip

    async def drain(self) -> None:
        """Wait for the shadow calls in flight, however long they take (tests; shutdown uses `close`)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """Stop sampling, let the calls in flight finish (cancelled after `grace_s`), close the store.

        Runs before the upstream pool and the embedder close, so no call outlives what it uses.
        """
        self._closed = True
        tasks = list(self._tasks)
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=grace_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            if late:
                log.warning("shutdown cancelled %d shadow comparison(s) still in flight", len(late))
        await self.store.close()


def build(services: Services) -> ShadowHook | None:
    """The shadow hook, or None when sampling is off everywhere or there is nothing to compare with."""
    section = services.policy.section("shadow")
    config = ShadowConfig.from_section(section)
    any_override = any(
        float((rule.get("set") or {}).get("sample_rate", 0.0) or 0.0) > 0 for rule in section.get("overrides") or ()
    )
    cache = services.policy.section("cache")
    bound = services.cache is not None and (
        cache.get("max_error_rate") is not None
        or any((rule.get("set") or {}).get("max_error_rate") is not None for rule in cache.get("overrides") or ())
    )
    routes = services.route_quality is not None  # lanes.upstream.tiers.max_quality_loss
    learned = services.learn is not None and services.learn.serving is not None  # learned templates' answers
    if not config.enabled or (config.sample_rate <= 0.0 and not any_override and not bound and not routes and not learned):
        return None
    if not services.pool.has_upstreams():
        log.warning("shadow sampling is on but no upstream is configured: shadow comparisons are off")
        return None
    if services.embedder is None:
        log.warning("shadow sampling is on but the embedder is off: nothing will be compared")
    store = ShadowStore(services.settings.state_dir / FILENAME, max_rows=config.max_rows,
                        max_age_s=config.max_age_days * 86400.0)  # fmt: skip
    return ShadowHook(services, config, store)
