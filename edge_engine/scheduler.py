"""Continuous batching: one thread owns the llama.cpp context and decodes every active sequence per step.

Failures are contained: an error while admitting a request fails that request; an error inside
a step fails the sequences in that step and the loop goes on; only repeated step failures, or
an error while cleaning up, end the thread, and then every request it held is failed before
the context is freed and the engine (the supervisor) starts a fresh scheduler.

How many prompt tokens a step carries comes from the cost model in step_cost.py; finished
prompts kept for reuse live in the prefix cache of prefix_cache.py.

Greedy sequences may speculate (prompt lookup): the tokens that followed the sequence's last
n-gram earlier in its own prompt or output are decoded as a draft in the same step, and the
longest prefix the model agrees with is kept; see `lookup_draft` and `Scheduler._drafts`.

Each sampled token's confidence is read from the logits row it was sampled from (confidence.py)
and goes out with the event that releases its text (text.py); a sequence whose output loops,
or (when asked) stays unsure for a run of tokens, ends early (degeneration.py).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable

from edge_engine.confidence import token_info
from edge_engine.degeneration import LoopDetector, LowConfidenceRun
from edge_engine.errors import EngineBusy, EngineFailure, GrammarTooComplex, InvalidInput
from edge_engine.events import GenerationEvent, PrefixEntry, Sequence, TokenInfo
from edge_engine.llama_model import BatchEntry, LlamaContext, LlamaModel
from edge_engine.prefix_cache import PrefixCache
from edge_engine.sampling import build_sampler
from edge_engine.settings import EdgeSettings
from edge_engine.speculative import DraftCost, lookup_draft, match_kind, match_prior
from edge_engine.start_probes import start_costs
from edge_engine.stats import EngineStats
from edge_engine.step_cost import StepCost
from edge_engine.text import TokenText

log = logging.getLogger(__name__)

MAX_STEP_FAILURES = 3  # consecutive failed steps after which the context is no longer trusted
TENANTS_SEEN_S = 60.0  # a tenant that submitted this recently shares the slots (edge.tenant_slot_share)
# A sequence's acceptance: draft tokens kept against drafts cut short, decayed per draft, over a
# prior from the match length worth PRIOR_WEIGHT drafts; it sets the draft length through the
# cost model (speculative.py).
PRIOR_WEIGHT = 3.0
DECAY = 0.7
FIRST_PAUSE = 16  # decode steps a sequence whose drafts do not pay waits before drafting again (doubles)


class Scheduler:
    """Admits queued requests into free slots, then loops: build one batch, decode, sample.

    NOTE: `_cond` guards `_waiting`, `_cancelled` and `_stopping`, the only state the
    event loop touches; everything else (context, active sequences, prefix entries)
    belongs to the scheduler thread alone, so llama.cpp is never called concurrently.
    """

    def __init__(self, settings: EdgeSettings, stats: EngineStats, model: LlamaModel) -> None:
        self.settings = settings
        self.stats = stats
        self.model = model  # owned by the engine: it outlives any one scheduler
        self.ctx: LlamaContext | None = None
        self._cond = threading.Condition()
        self._waiting: list[tuple[int, int, Sequence]] = []  # heap on (priority, arrival)
        self._cancelled: list[Sequence] = []
        self._stopping = False
        self._seen: dict[str, float] = {}  # tenant (scope) -> when it last submitted
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._active: list[Sequence] = []
        # NOTE: a min-heap, so active ids stay packed: with a KV stream per sequence llama.cpp
        # splits a step into one pass per run of consecutive sequence ids.
        self._free_ids = list(range(settings.slots))
        self._prefixes: PrefixCache | None = None  # made with the context, on the scheduler thread
        self._reserved = 0  # KV cells promised to active sequences (prefix entries count their own)
        self._last_step_decoded = True
        self._last_decode_at = 0.0
        # Prompt step cost model, calibrated once at start (see step_cost.py)
        self.steps = StepCost(settings.prefill_chunk)
        self.draft_cost = DraftCost()  # timed at start when speculation is enabled
        # NOTE: drafts are exact (greedy text identical with and without them, alone and
        # batched; tests/unit/edge_engine/test_speculative.py, bench/edge_speculative.py) only
        # where a token's numbers do not depend on how many rows of its sequence a step carries:
        # a KV stream per sequence (in a shared pool rejected drafts move where later cells
        # land), flash attention over a quantized cache (its per-row path; without flash
        # attention the f16 attention matmuls round differently for a multi-row step: 5 of 14
        # prompts changed text with drafts) and CPU kernels (GPU builds pick other matmul
        # kernels by batch size: not verified). Elsewhere drafts are off.
        self.speculate = (
            settings.speculative.enabled
            and settings.batch_invariant
            and settings.flash_attn
            and settings.n_gpu_layers == 0
        )
        self._service_s = 2.0  # running mean of request durations, for Retry-After
        self._in_step: list[Sequence] = []  # the sequences of the step being run
        self._step_failures = 0  # consecutive
        self.failure: BaseException | None = None  # why the thread ended, when it was not stop()

    # ---- called from the event loop -------------------------------------------------

    def start(
        self,
        on_ready: Callable[[BaseException | None], None],
        on_exit: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        """Starts the thread; `on_ready` gets the start-up error or None, `on_exit` why the loop ended."""
        self._thread = threading.Thread(
            target=self._main, args=(on_ready, on_exit), name="edge-scheduler", daemon=True
        )
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the scheduler thread is alive and takes work."""
        with self._cond:
            stopping = self._stopping
        return not stopping and self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    def submit(self, seq: Sequence) -> None:
        with self._cond:
            if self._stopping:
                raise EngineBusy("the edge engine is shutting down", retry_after=5)
            if len(self._waiting) >= self.settings.max_queue:
                self.stats.rejected_total += 1
                raise EngineBusy(
                    f"the edge engine queue is full ({len(self._waiting)} requests waiting); retry later",
                    retry_after=self._retry_after(len(self._waiting)),
                )
            now = time.perf_counter()
            self._seen[seq.scope] = now
            if len(self._seen) > 1024:
                self._seen = {k: t for k, t in self._seen.items() if now - t < TENANTS_SEEN_S}
            own = sum(1 for w in self._waiting if w[2].scope == seq.scope)
            if own >= self.settings.tenant_max_queue and self._shared(now):
                # NOTE: one tenant may not fill the whole queue while others are about: the rest stays theirs
                self.stats.rejected_total += 1
                raise EngineBusy(
                    f"this tenant already has {own} requests waiting for the edge engine; retry later",
                    retry_after=self._retry_after(own),
                )
            seq.order = next(self._order)
            heapq.heappush(self._waiting, (int(seq.priority), seq.order, seq))
            self._cond.notify()

    def cancel(self, seq: Sequence) -> None:
        with self._cond:
            self._cancelled.append(seq)
            self._cond.notify()

    def load(self) -> dict[str, int | float]:
        with self._cond:
            waiting = len(self._waiting)
        prefixes, steps = self._prefixes, self.steps
        prefix_cells = prefixes.cells if prefixes is not None else 0
        own = [s.n_past - s.cached for s in self._active]
        return {
            "queue_depth": waiting,
            "active_sequences": len(self._active),
            "kv_cells_reserved": self._reserved + prefix_cells,
            "kv_cells_used": sum(own) + prefix_cells,
            # cells each active sequence computed itself (borrowed prefix cells are counted once, above)
            "kv_cells_per_sequence_max": max(own, default=0),
            "kv_cells_per_sequence_mean": round(sum(own) / len(own), 1) if own else 0.0,
            "kv_cells_total": self.ctx.n_ctx_total if self.ctx else self.settings.n_ctx,
            "slots": self.settings.slots,
            "prefix_entries": len(prefixes) if prefixes is not None else 0,
            "prompt_tokens_per_step": steps.chunk,
            # timed at start: what the first and each further draft row add to a one-token step
            "spec_draft_row_cost_first": round(self.draft_cost.first, 3),
            "spec_draft_row_cost": round(self.draft_cost.row, 3),
            "prompt_tokens_per_step_at_n_ctx": steps.piece(self.ctx.n_ctx - 1 if self.ctx else self.settings.n_ctx - 1),
        }

    def _retry_after(self, waiting: int) -> float:
        return min(60.0, max(1.0, self._service_s * (1 + waiting) / self.settings.slots))

    # ---- the scheduler thread -------------------------------------------------------

    def _main(
        self, on_ready: Callable[[BaseException | None], None], on_exit: Callable[[BaseException | None], None] | None
    ) -> None:
        try:
            s = self.settings
            self.ctx = LlamaContext(
                self.model,
                n_ctx=s.n_ctx,
                n_batch=s.n_batch,
                n_seq_max=s.n_seq_max,
                n_threads=s.n_threads,
                flash_attn=s.flash_attn,
                kv_cache_type=s.kv_cache_type or "f16",  # set by the settings' validator
                per_sequence_streams=s.batch_invariant,
            )
            self._prefixes = PrefixCache(
                self.ctx, range(s.slots, s.n_seq_max), enabled=s.prefix_reuse, min_tokens=s.min_prefix_tokens
            )
            costs = start_costs(self.ctx, self.model, self._free_ids[0], s, speculate=self.speculate)
            self.steps = costs.steps
            if costs.draft is not None:
                self.draft_cost = costs.draft
        except BaseException as exc:  # noqa: BLE001 - handed to start(), which raises it on the loop
            with self._cond:
                self._stopping = True
            if self.ctx is not None:
                self.ctx.close()
            on_ready(exc)
            return
        on_ready(None)
        try:
            self._loop()
        except BaseException as exc:
            log.exception("the edge scheduler failed; failing its requests and handing over to a fresh one")
            self.failure = exc
        finally:
            self._shutdown()
            if on_exit is not None:
                on_exit(self.failure)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._waiting or self._active or self._cancelled):
                    self._cond.wait()
                if self._stopping:
                    return
                cancelled, self._cancelled = self._cancelled, []
                for seq in cancelled:
                    self._drop_waiting(seq)
                self._expire_waiting()
            for seq in cancelled:
                if seq in self._active:
                    self._release(seq, keep_prefix=False)
            self._admit()
            if self._active:
                self._guarded_step()

    def _guarded_step(self) -> None:
        """One step; an error fails the sequences in it and the loop goes on (or ends, see below)."""
        try:
            self._step()
        except Exception as exc:
            self._step_failures += 1
            self.stats.step_failures_total += 1
            victims = [s for s in self._in_step if s in self._active] or list(self._active)
            log.exception("edge step failed (%d sequences in it, failure %d in a row)", len(victims), self._step_failures)
            for seq in victims:
                seq.deliver(EngineFailure(f"the edge engine failed while generating this answer ({type(exc).__name__}); retry", retry_after=1))
                # NOTE: an error here (the context is broken) ends the thread: the supervisor restarts it
                self._release(seq, keep_prefix=False)
            if self._step_failures >= MAX_STEP_FAILURES:
                raise RuntimeError(f"{self._step_failures} edge steps failed in a row; restarting the context") from exc
        else:
            self._step_failures = 0
        finally:
            self._in_step = []

    def _drop_waiting(self, seq: Sequence) -> None:
        before = len(self._waiting)
        self._waiting = [w for w in self._waiting if w[2] is not seq]
        if len(self._waiting) != before:
            heapq.heapify(self._waiting)

    def _expire_waiting(self) -> None:
        limit = time.perf_counter() - self.settings.max_queue_wait_s
        expired = [w for w in self._waiting if w[2].enqueued_at < limit]
        if not expired:
            return
        self._waiting = [w for w in self._waiting if w[2].enqueued_at >= limit]
        heapq.heapify(self._waiting)
        for _, _, seq in expired:
            self.stats.rejected_total += 1
            seq.deliver(EngineBusy("the edge engine is busy: no KV cells freed up in time", retry_after=self._retry_after(len(self._waiting))))

    def _admit(self) -> None:
        assert self.ctx is not None and self._prefixes is not None
        while self._free_ids:
            with self._cond:
                picked = self._next_waiting()
                if picked is None:
                    return
                seq = picked[2]
            source, shared = self._prefixes.best(seq.prompt, seq.scope, self._active)
            entry = source if isinstance(source, PrefixEntry) else None
            borrowed = shared if entry is not None else 0
            need = len(seq.prompt) - borrowed + seq.max_new
            if not self._prefixes.make_room(need, self._reserved, keep=entry):
                return  # the head of the queue waits for cells; order is kept
            with self._cond:
                self._waiting.remove(picked)
                heapq.heapify(self._waiting)
            seq.seq_id = heapq.heappop(self._free_ids)
            seq.admitted_at = time.perf_counter()
            self.ctx.seq_rm(seq.seq_id)
            if source is not None and shared:
                self.ctx.copy_prefix(source.seq_id, seq.seq_id, shared)
                seq.n_past = seq.cached = shared
                if entry is not None:
                    self._prefixes.borrow(entry)
                    seq.prefix = entry
            seq.tokens = list(seq.prompt[: seq.n_past])
            seq.reserved = need
            self._reserved += need
            self._active.append(seq)
            try:
                p = seq.params
                seq.sampler = build_sampler(p, self.settings.seed, self.model.n_vocab, self.model.vocab)
                seq.text = TokenText(list(p.stop))
                seq.loops = LoopDetector() if p.stop_on_loop else None
                if p.low_confidence_run > 0:
                    seq.low_confidence = LowConfidenceRun(p.low_confidence_run, p.low_confidence_logprob)
                # NOTE: drafts are checked against the greedy token only, and sampling a draft
                # row through a chain with penalties would record tokens that may be rejected:
                # sequences with penalties or temperature > 0 never speculate.
                seq.spec = (
                    self.speculate
                    and p.greedy
                    and p.repeat_penalty == 1.0
                    and not p.presence_penalty
                    and not p.frequency_penalty
                )
            except InvalidInput as exc:  # a grammar llama.cpp cannot parse (normally caught at submit)
                seq.deliver(exc)
                self._release(seq, keep_prefix=False)
                continue
            except Exception as exc:
                log.exception("could not set up sampling for an edge request")
                seq.deliver(EngineFailure(f"the edge engine could not set up sampling for this request: {exc}"))
                self._release(seq, keep_prefix=False)
                continue
            self.stats.requests_total += 1
            self.stats.cached_tokens_total += seq.cached

    def _next_waiting(self) -> tuple[int, int, Sequence] | None:
        """The waiting request that gets the next free slot (under `_cond`); None: none may have it now.

        NOTE: fair between tenants (a request's scope): by priority, then the tenant with the
        fewest running requests, then arrival. While another tenant is running, waiting, or
        submitted within TENANTS_SEEN_S, no tenant takes more than edge.tenant_slot_share of the
        slots, so the rest stay free for the others: another tenant's request is admitted at the
        next step and its prompt goes first (the shortest ingestion left goes first). A tenant
        alone leaves edge.lone_tenant_reserve slots free, so a newcomer is admitted at the next
        step too.
        """
        if not self._waiting:
            return None
        running: dict[str, int] = {}
        for active in self._active:
            running[active.scope] = running.get(active.scope, 0) + 1
        shared = self._shared(time.perf_counter(), running)
        # NOTE: a tenant alone still leaves edge.lone_tenant_reserve slots free: a tenant that
        # arrives next is admitted at the next step, not after one of the running requests ends
        cap = self.settings.tenant_max_slots if shared else self.settings.lone_tenant_max_slots
        best: tuple[int, int, Sequence] | None = None
        best_key: tuple[int, int, int] | None = None
        for entry in self._waiting:
            held = running.get(entry[2].scope, 0)
            if held >= cap:
                continue
            key = (entry[0], held, entry[1])
            if best_key is None or key < best_key:
                best, best_key = entry, key
        return best

    def _shared(self, now: float, running: Iterable[str] = ()) -> bool:
        """Whether more than one tenant is about (under `_cond`): submitted within TENANTS_SEEN_S, waiting,
        or in `running` (the scheduler thread passes its active tenants): then the shares apply."""
        first: str | None = None
        for scope, seen_at in self._seen.items():
            if now - seen_at < TENANTS_SEEN_S:
                if first is None:
                    first = scope
                elif scope != first:
                    return True
        scopes = set(running) | {w[2].scope for w in self._waiting}
        if first is not None:
            scopes.add(first)
        return len(scopes) > 1

    def expected_seconds(self, prompt_tokens: int, output_tokens: int) -> float | None:
        """What `prompt_tokens` of prompt and `output_tokens` decoded alone take on this context,
        from the step costs measured here (the prompt cost model timed at start, the cost of a lone
        decode step seen since); None until both are known."""
        decode_s = self.stats.solo_decode_s()
        if decode_s is None or not self.steps.modelled:
            return None
        return self.steps.cost(0, prompt_tokens) / 1000.0 + output_tokens * decode_s

    def _decode_turn(self, now: float) -> bool:
        """Whether this step decodes the running sequences rather than ingesting prompts."""
        if self._last_step_decoded:
            return False  # a prompt step always follows a decode step
        return (now - self._last_decode_at) * 1000.0 >= self.settings.decode_gap_ms

    def _step(self) -> None:
        assert self.ctx is not None and self.model is not None
        parts: list[tuple[Sequence, list[BatchEntry]]] = []
        decoding = [s for s in self._active if not s.prefilling]
        budget = self.steps.budget()
        started = time.perf_counter()
        if decoding and not self.settings.mix_prefill and any(s.prefilling for s in self._active):
            # NOTE: prompt chunks get their own steps. Prompts go first (new requests reach
            # their first token sooner); running sequences still decode every decode_gap_ms.
            if self._decode_turn(started):
                budget = 0
            else:
                decoding = []
        drafts = self._drafts(decoding)
        for seq in decoding:
            assert seq.last_token is not None
            draft = drafts.get(seq.seq_id, [])
            part = [BatchEntry(seq.last_token, seq.n_past, seq.seq_id, True)]
            part += [BatchEntry(t, seq.n_past + 1 + i, seq.seq_id, True) for i, t in enumerate(draft)]
            parts.append((seq, part))
        n_decode = sum(len(part) for _, part in parts)
        # NOTE: the prompt with the least ingestion time left goes first (by the cost model,
        # not by tokens: the last 18 tokens of a 1,500-token prompt cost twice a fresh 20-token
        # one); a prompt's next piece joins the step only if it fits whole, so a long prompt does
        # not share a step with short ones.
        prefilling = sorted(
            (s for s in self._active if s.prefilling),
            key=lambda s: (int(s.priority), self.steps.cost(s.n_past, len(s.prompt) - s.n_past), s.order),
        )
        width = 0
        for seq in prefilling:
            # NOTE: where a prompt is cut depends only on where each piece starts, whatever
            # shares the step: greedy text must not depend on other traffic.
            take = min(len(seq.prompt) - seq.n_past, self.steps.piece(seq.n_past))
            cost = self.steps.cost(seq.n_past, take)
            # the first piece always goes (it was sized to the step); others only if they fit
            if budget <= 0 or (width and budget < cost * (1.0 - 1e-9)):
                break
            if n_decode + sum(len(part) for _, part in parts[len(decoding) :]) + take > self.ctx.n_batch:
                break  # drafts took the room (only when prompt pieces share steps with decodes)
            # NOTE: with a KV stream per sequence llama.cpp splits a step into passes of equal
            # tokens per sequence, so pieces of unequal length would be cut again by their
            # neighbours (and a 1-token remainder takes other kernels). Only equal pieces share.
            if width and take != width and self.settings.batch_invariant:
                continue
            width = take
            piece = [
                BatchEntry(seq.prompt[i], i, seq.seq_id, i == len(seq.prompt) - 1)
                for i in range(seq.n_past, seq.n_past + take)
            ]
            parts.append((seq, piece))
            budget -= cost
        # NOTE: llama.cpp packs a step into one pass only over ascending, consecutive sequence
        # ids (one KV stream each); any other order costs an extra pass over the weights.
        parts.sort(key=lambda part: part[0].seq_id)
        self._in_step = [seq for seq, _ in parts]
        entries: list[BatchEntry] = []
        rows: list[tuple[Sequence, int, list[int]]] = []  # sequence, its first logits row, its draft
        for seq, part in parts:
            first = len(entries)
            entries.extend(part)
            if not seq.prefilling:
                rows.append((seq, first, drafts.get(seq.seq_id, [])))
            elif part[-1].logits:
                rows.append((seq, len(entries) - 1, []))
        rc = self.ctx.decode(entries)
        if rc != 0:
            self._fail_step(rc)
            return
        n_prompt = len(entries) - n_decode
        if n_decode:
            self._last_decode_at = started
        self._last_step_decoded = n_decode > 0
        self._advance(entries)
        now = time.perf_counter()
        verified: list[tuple[Sequence, list[int], list[TokenInfo]]] = []
        for seq, index, draft in rows:
            # the model's own token after each kept one, up to the first that differs from the draft
            assert seq.sampler is not None
            timed = seq.sampler.grammar is not None
            began = time.perf_counter() if timed else 0.0
            tokens = [self.ctx.sample(seq.sampler, index)]
            while len(tokens) <= len(draft) and tokens[-1] == draft[len(tokens) - 1]:
                tokens.append(self.ctx.sample(seq.sampler, index + len(tokens)))
            if timed:
                seq.sampling_s += time.perf_counter() - began
            # each token's confidence from its own row (sampling leaves the logits as they were)
            k = seq.params.top_logprobs
            infos = [
                token_info(self.ctx.logits(index + i), t, self.model.piece, k) for i, t in enumerate(tokens)
            ]
            if draft:
                rejected = len(draft) - (len(tokens) - 1)
                if rejected:
                    seq.n_past -= rejected
                    del seq.tokens[seq.n_past :]
                    self.ctx.seq_rm(seq.seq_id, seq.n_past, -1)
                    n_decode -= rejected
                self._judge(seq, len(draft), len(tokens) - 1)
            verified.append((seq, tokens, infos))
        self.stats.record_step(n_prompt, n_decode)
        if n_prompt == 0 and n_decode == 1 and len(rows) == 1 and not drafts:
            self.stats.record_solo_decode(time.perf_counter() - started)
        limit_s = self.settings.grammar.max_sampling_ms / 1000.0
        for seq, tokens, infos in verified:
            if seq.sampling_s > limit_s:
                # NOTE: grammar work is this request's own, and it delays every sequence in the step
                self.stats.grammar_stops_total += 1
                seq.deliver(GrammarTooComplex(
                    f"this request's grammar took more than {limit_s:g} s of sampling; simplify the response_format",
                    param="response_format",
                ))
                self._release(seq, keep_prefix=False)
                continue
            for token, info in zip(tokens, infos):
                # NOTE: token by token, as without drafts: a stop string, an end-of-generation
                # token, a loop or max_tokens ends the sequence at the same token, even mid-draft.
                self._on_token(seq, token, info, now)
                if seq not in self._active:
                    break  # it finished

    def _drafts(self, decoding: list[Sequence]) -> dict[int, list[int]]:
        """Draft tokens per sequence id for this decode step (prompt lookup), possibly none."""
        spec = self.settings.speculative
        candidates = [s for s in decoding if s.spec]
        if not candidates:
            return {}
        if len(decoding) >= spec.max_batch:
            # NOTE: each draft row costs about half a one-token step on CPU whatever shares it,
            # while a step of many sequences already fills the cores: past the measured
            # crossover (bench/edge_speculative.py) drafts lose more than they gain.
            self.stats.spec_skipped_steps_total += 1
            return {}
        drafts: dict[int, list[int]] = {}
        for seq in candidates:
            if seq.spec_pause > 0:
                seq.spec_pause -= 1
                continue
            assert seq.last_token is not None
            room = min(spec.max_draft, seq.max_new - seq.generated - 1)  # never past max_tokens
            draft, match = lookup_draft(seq.tokens, seq.last_token, spec.ngram_sizes, room)
            if not draft:
                continue
            # NOTE: short matches (common phrasing) and long ones (a copy in progress) keep very
            # different shares of their drafts, so each kind has its own record and prior.
            kind = match_kind(match)
            hits, misses = seq.hits[kind], seq.misses[kind]
            p = (hits + PRIOR_WEIGHT * match_prior(match)) / (hits + misses + PRIOR_WEIGHT)
            length = self.draft_cost.length(p, len(draft)) if p >= spec.min_acceptance else 0
            if length:
                drafts[seq.seq_id] = draft[:length]
                seq.draft_kind = kind
        if len(drafts) > 1:
            # NOTE: with a KV stream per sequence llama.cpp splits a step into passes of equal
            # tokens per sequence (see _step): drafts of one length cost one extra pass at most.
            # Exactness does not depend on it (rows are computed independently on CPU).
            n = min(len(d) for d in drafts.values())
            drafts = {k: d[:n] for k, d in drafts.items()}
        return drafts

    def _judge(self, seq: Sequence, drafted: int, kept: int) -> None:
        """Updates a sequence's acceptance; pauses it while its drafts do not pay."""
        self.stats.record_draft(drafted, kept)
        k = seq.draft_kind
        seq.hits[k] = seq.hits[k] * DECAY + kept
        seq.misses[k] = seq.misses[k] * DECAY + (kept < drafted)
        if seq.misses[k] > seq.hits[k] and seq.misses[k] >= 1.0:
            # NOTE: a rejected draft row costs about half a plain step for nothing; a sequence
            # whose drafts miss more than they keep backs off, doubling the wait each time.
            seq.spec_pause = FIRST_PAUSE << min(seq.spec_pauses, 6)
            seq.spec_pauses += 1
            seq.hits, seq.misses = [0.0, 0.0], [0.0, 0.0]

    def _advance(self, entries: list[BatchEntry]) -> None:
        by_id = {s.seq_id: s for s in self._active}
        for e in entries:
            seq = by_id[e.seq_id]
            seq.n_past = e.pos + 1
            seq.tokens.append(e.token)

    def _fail_step(self, rc: int) -> None:
        # NOTE: reservations make a full KV cache (rc 1) unexpected; fail the newest
        # sequence so the others keep their cells, and report any other code as overload.
        log.error("llama_decode returned %d with %d active sequences", rc, len(self._active))
        victim = max(self._active, key=lambda s: s.order)
        victim.deliver(EngineBusy(f"the edge engine could not decode (llama_decode={rc}); retry later", retry_after=2))
        self._release(victim, keep_prefix=False)

    def _on_token(self, seq: Sequence, token: int, info: TokenInfo, now: float) -> None:
        assert self.model is not None and seq.text is not None
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.stats.record_ttft(now - seq.enqueued_at)
        seq.generated += 1
        if self.model.is_eog(token):
            self._finish(seq, *seq.text.finish(), "stop")
            return
        period = seq.loops.push(token) if seq.loops is not None else 0
        # NOTE: the text of a repeat in progress is held back, so that if it proves a loop its
        # repeats are dropped instead of streamed; a repeat that breaks off goes out with the
        # token that breaks it (one repeated sentence: its length late, a few tokens at most).
        hold = seq.loops.repeating if seq.loops is not None else 0
        text, infos, hit = seq.text.push(info.piece, info, hold)
        if hit:
            self._finish(seq, text, infos, "stop")
        elif period:
            assert seq.loops is not None
            self.stats.loop_stops_total += 1
            rest, more = seq.text.finish(drop=seq.loops.repeats(period))
            self._finish(seq, text + rest, infos + more, "loop")
        elif seq.low_confidence is not None and seq.low_confidence.push(info.logprob):
            self.stats.low_confidence_stops_total += 1
            rest, more = seq.text.finish()
            self._finish(seq, text + rest, infos + more, "low_confidence")
        elif seq.generated >= seq.max_new or now - seq.admitted_at >= self.settings.max_request_s:
            rest, more = seq.text.finish()
            self._finish(seq, text + rest, infos + more, "length")
        else:
            seq.last_token = token
            seq.deliver(GenerationEvent(text=text, completion_tokens=seq.generated, tokens=tuple(infos)))

    def _finish(self, seq: Sequence, text: str, infos: list[TokenInfo], reason: str) -> None:
        event = GenerationEvent(
            text=text,
            completion_tokens=seq.generated,
            finish_reason=reason,
            prompt_tokens=len(seq.prompt),
            cached_tokens=seq.cached,
            tokens=tuple(infos),
        )
        self._service_s = 0.9 * self._service_s + 0.1 * (time.perf_counter() - seq.enqueued_at)
        try:
            # NOTE: freed before the caller hears of the end, so the engine's stats read on the
            # last event no longer count the sequence (slot, KV cells)
            self._release(seq, keep_prefix=True)
        finally:
            seq.deliver(event)

    def _release(self, seq: Sequence, keep_prefix: bool) -> None:
        assert self.ctx is not None and self._prefixes is not None
        self._active.remove(seq)
        if keep_prefix:
            # before its cells go and its borrowed entry is given back (that one is not idle yet)
            self._prefixes.keep(seq, reserved=self._reserved - seq.reserved)
        self.ctx.seq_rm(seq.seq_id)
        heapq.heappush(self._free_ids, seq.seq_id)
        self._reserved -= seq.reserved
        if seq.prefix is not None:
            self._prefixes.give_back(seq.prefix)
        if seq.sampler is not None:
            seq.sampler.close()
            seq.sampler = None

    def _shutdown(self) -> None:
        """Refuses new work, fails every request held, then frees the context (never the model)."""
        with self._cond:
            self._stopping = True  # submit() refuses from here on
            waiting = [w[2] for w in self._waiting]
            self._waiting = []
        reason = "the edge engine shut down" if self.failure is None else "the edge engine failed and is restarting"
        for seq in waiting + list(self._active):
            seq.deliver(EngineBusy(f"{reason}; retry", retry_after=1 if self.failure is not None else 5))
        for seq in list(self._active):
            try:
                self._release(seq, keep_prefix=False)
            except Exception:
                log.exception("releasing a sequence at shutdown failed")
        self._active = []
        if self.ctx is not None:
            self.ctx.close()
