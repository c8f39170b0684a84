"""Continuous batching: one thread owns the llama.cpp context and decodes every active sequence per step.

Failures are contained: an error while admitting a request fails that request; an error inside
a step fails the sequences in that step and the loop goes on; only repeated step failures, or
an error while cleaning up, end the thread, and then every request it held is failed before
the context is freed and the engine (the supervisor) starts a fresh scheduler.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable

import llama_cpp

from edge_engine.events import GenerationEvent, PrefixEntry, Sequence
from edge_engine.llama_model import BatchEntry, LlamaContext, LlamaModel
from edge_engine.sampling import build_sampler
from edge_engine.settings import EdgeSettings
from edge_engine.stats import EngineStats
from edge_engine.text import StopMatcher
from edge_engine.errors import EngineBusy, EngineFailure

log = logging.getLogger(__name__)

PROBE_TOKENS = 32  # scratch prompt timed at start to size prompt steps
PROBE_DEPTH = 512  # ... once at position 0 and once after this many cells (a shallower probe misread the slope by 2x)
MAX_STEP_FAILURES = 3  # consecutive failed steps after which the context is no longer trusted


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
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._active: list[Sequence] = []
        # NOTE: a min-heap, so active ids stay packed: with a KV stream per sequence llama.cpp
        # splits a step into one pass per run of consecutive sequence ids.
        self._free_ids = list(range(settings.slots))
        self._prefixes: list[PrefixEntry] = []
        self._prefix_ids = list(range(settings.slots, settings.n_seq_max))
        self._reserved = 0  # KV cells promised to active sequences and prefix entries
        self._last_step_decoded = True
        self._last_decode_at = 0.0
        # Prompt step cost model, calibrated once at start: a prompt token at position p costs
        # about _ms_token + _ms_cell * p (attention reads every earlier cell).
        self._ms_token = 0.0
        self._ms_cell = 0.0
        self.chunk = settings.prefill_chunk  # prompt tokens per step at position 0
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
            seq.order = next(self._order)
            heapq.heappush(self._waiting, (int(seq.priority), seq.order, seq))
            self._cond.notify()

    def cancel(self, seq: Sequence) -> None:
        with self._cond:
            self._cancelled.append(seq)
            self._cond.notify()

    def load(self) -> dict[str, int]:
        with self._cond:
            waiting = len(self._waiting)
        return {
            "queue_depth": waiting,
            "active_sequences": len(self._active),
            "kv_cells_reserved": self._reserved,
            "kv_cells_used": sum(s.n_past - s.cached for s in self._active)
            + sum(len(p.tokens) for p in self._prefixes),
            "kv_cells_total": self.ctx.n_ctx_total if self.ctx else self.settings.n_ctx,
            "slots": self.settings.slots,
            "prefix_entries": len(self._prefixes),
            "prompt_tokens_per_step": self.chunk,
            "prompt_tokens_per_step_at_n_ctx": self._piece(self.ctx.n_ctx - 1 if self.ctx else self.settings.n_ctx - 1),
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
                kv_cache_type=s.kv_cache_type,
                per_sequence_streams=s.batch_invariant,
            )
            self.chunk = self._calibrate_steps()
        except BaseException as exc:  # handed to start(), which raises it on the loop
            with self._cond:
                self._stopping = True
            if self.ctx is not None:
                self.ctx.close()
            on_ready(exc)
            return
        on_ready(None)
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - reported to the supervisor, never lost
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
        except Exception as exc:  # noqa: BLE001 - contained to the sequences of this step
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
        assert self.ctx is not None
        while self._free_ids:
            with self._cond:
                if not self._waiting:
                    return
                seq = self._waiting[0][2]
            source, shared = self._best_prefix(seq.prompt, seq.scope)
            borrowed = shared if isinstance(source, PrefixEntry) else 0
            need = len(seq.prompt) - borrowed + seq.max_new
            if not self._make_room(need, keep=source if isinstance(source, PrefixEntry) else None):
                return  # the head of the queue waits for cells; order is kept
            with self._cond:
                heapq.heappop(self._waiting)
            seq.seq_id = heapq.heappop(self._free_ids)
            self.ctx.seq_rm(seq.seq_id)
            if source is not None and shared:
                self.ctx.copy_prefix(source.seq_id, seq.seq_id, shared)
                seq.n_past = seq.cached = shared
                if isinstance(source, PrefixEntry):
                    source.refs += 1
                    source.last_used = time.perf_counter()
                    seq.prefix = source
            seq.tokens = list(seq.prompt[: seq.n_past])
            seq.reserved = need
            self._reserved += need
            self._active.append(seq)
            try:
                seq.sampler = build_sampler(seq.params, self.settings.seed, self.model.n_vocab)
                seq.stop = StopMatcher(list(seq.params.stop))
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                log.exception("could not set up sampling for an edge request")
                seq.deliver(EngineFailure(f"the edge engine could not set up sampling for this request: {exc}"))
                self._release(seq, keep_prefix=False)
                continue
            self.stats.requests_total += 1
            self.stats.cached_tokens_total += seq.cached

    def _best_prefix(self, prompt: list[int], scope: str) -> tuple[PrefixEntry | Sequence | None, int]:
        best: PrefixEntry | Sequence | None = None
        best_len = 0
        if not self.settings.prefix_reuse:
            return None, 0
        candidates: list[tuple[PrefixEntry | Sequence, list[int], int]] = [
            (p, p.tokens, len(p.tokens)) for p in self._prefixes if p.scope == scope
        ] + [(s, s.tokens, s.n_past) for s in self._active if s.scope == scope]
        best_cells = 0
        for source, tokens, limit in candidates:
            n = _common_prefix(tokens, prompt, limit)
            # NOTE: the state API copies every cell of the source, so of equal prefixes take the
            # smallest source (a 1,500-cell prompt costs 6-50 ms to copy, a short one ~2 ms).
            if n > best_len or (n and n == best_len and limit < best_cells):
                best, best_len, best_cells = source, n, limit
        # at least one prompt token must be decoded to get logits for the first sample
        best_len = min(best_len, len(prompt) - 1)
        if best_len < self.settings.min_prefix_tokens:
            return None, 0
        return best, best_len

    def _make_room(self, need: int, keep: PrefixEntry | None) -> bool:
        assert self.ctx is not None
        if self.ctx.per_sequence_streams:
            return True  # each sequence owns n_ctx cells; submit() caps prompt + completion at that
        while self._reserved + need > self.ctx.n_ctx:
            idle = [p for p in self._prefixes if p.refs == 0 and p is not keep]
            if not idle:
                return False
            self._evict(min(idle, key=lambda p: p.last_used))
        return True

    def _evict(self, entry: PrefixEntry) -> None:
        assert self.ctx is not None
        self.ctx.seq_rm(entry.seq_id)
        self._prefixes.remove(entry)
        self._prefix_ids.append(entry.seq_id)
        self._reserved -= len(entry.tokens)

    def _calibrate_steps(self) -> int:
        """Times a scratch prompt at position 0 and after PROBE_DEPTH cells, once, at start.

        Prompt steps are then sized from that cost model to take about prefill_step_ms at
        any depth of a prompt (at most prefill_chunk tokens). The sizes depend only on where
        a piece starts, never on load or on what shares the step.
        """
        s = self.settings
        if s.prefill_step_ms is None:
            return s.prefill_chunk
        assert self.ctx is not None and self.model is not None
        probe = (self.model.tokenize("The quick brown fox jumps over the lazy dog. " * 8, add_special=False) * 4)[:PROBE_TOKENS]
        scratch = self._free_ids[0]
        depth = max(0, min(PROBE_DEPTH, self.ctx.n_ctx - 2 * len(probe)))

        def timed(start: int) -> float | None:
            begin = time.perf_counter()
            rc = self.ctx.decode([BatchEntry(t, start + i, scratch, i == len(probe) - 1) for i, t in enumerate(probe)])
            elapsed = (time.perf_counter() - begin) * 1000.0 / len(probe)
            self.ctx.seq_rm(scratch, start, -1)
            return None if rc != 0 else elapsed

        try:
            near = [timed(0) for _ in range(3)][1:]  # the first pass pays for graph allocation
            far: list[float | None] = []
            if depth:
                fill = (probe * (depth // len(probe) + 1))[:depth]
                for lo in range(0, depth, self.ctx.n_batch):
                    part = fill[lo : lo + self.ctx.n_batch]
                    self.ctx.decode([BatchEntry(t, lo + i, scratch, False) for i, t in enumerate(part)])
                far = [timed(depth) for _ in range(2)]
        finally:
            self.ctx.seq_rm(scratch)
        if None in near or None in far:
            return min(s.prefill_chunk, 16)
        t0 = min(near)  # type: ignore[type-var]
        self._ms_cell = max(0.0, (min(far) - t0) / depth) if far else 0.0  # type: ignore[type-var]
        self._ms_token = max(1e-3, t0 - self._ms_cell * len(probe) / 2)
        chunk = self._piece(0)
        log.info(
            "edge prompt steps: %d tokens at position 0, %d at %d (%.2f ms per prompt token + %.4f ms per earlier cell)",
            chunk, self._piece(self.ctx.n_ctx - 1), self.ctx.n_ctx - 1, self._ms_token, self._ms_cell,
        )
        return chunk

    def _modelled(self) -> bool:
        return self.settings.prefill_step_ms is not None and self._ms_token > 0.0

    def _step_budget(self) -> float:
        """What one prompt step may carry: milliseconds of modelled work, else tokens."""
        return float(self.settings.prefill_step_ms) if self._modelled() else float(self.chunk)  # type: ignore[arg-type]

    def _piece(self, start: int) -> int:
        """Prompt tokens of one step starting at position `start`: about prefill_step_ms of work."""
        s = self.settings
        if not self._modelled():
            return self.chunk
        # n tokens from `start` cost n * (a + b * (start + n / 2)); the largest n within the step
        a, b, budget = self._ms_token + self._ms_cell * start, self._ms_cell, s.prefill_step_ms
        n = budget / a if b == 0.0 else (math.sqrt(a * a + 2.0 * b * budget) - a) / b
        return max(1, min(s.prefill_chunk, int(n)))

    def _piece_cost(self, start: int, n: int) -> float:
        if not self._modelled():
            return float(n)
        return n * (self._ms_token + self._ms_cell * (start + n / 2))

    def _decode_turn(self, now: float) -> bool:
        """Whether this step decodes the running sequences rather than ingesting prompts."""
        if self._last_step_decoded:
            return False  # a prompt step always follows a decode step
        return (now - self._last_decode_at) * 1000.0 >= self.settings.decode_gap_ms

    def _step(self) -> None:
        assert self.ctx is not None and self.model is not None
        parts: list[tuple[Sequence, list[BatchEntry]]] = []
        decoding = [s for s in self._active if not s.prefilling]
        for seq in decoding:
            assert seq.last_token is not None
            parts.append((seq, [BatchEntry(seq.last_token, seq.n_past, seq.seq_id, True)]))
        n_decode = len(parts)
        budget = self._step_budget()
        started = time.perf_counter()
        if parts and not self.settings.mix_prefill and any(s.prefilling for s in self._active):
            # NOTE: prompt chunks get their own steps. Prompts go first (new requests reach
            # their first token sooner); running sequences still decode every decode_gap_ms.
            if self._decode_turn(started):
                budget = 0
            else:
                parts, n_decode = [], 0
        # NOTE: the prompt with the least ingestion time left goes first (by the cost model,
        # not by tokens: the last 18 tokens of a 1,500-token prompt cost twice a fresh 20-token
        # one); a prompt's next piece joins the step only if it fits whole, so a long prompt does
        # not share a step with short ones.
        prefilling = sorted(
            (s for s in self._active if s.prefilling),
            key=lambda s: (int(s.priority), self._piece_cost(s.n_past, len(s.prompt) - s.n_past), s.order),
        )
        width = 0
        for seq in prefilling:
            # NOTE: where a prompt is cut depends only on where each piece starts, whatever
            # shares the step: greedy text must not depend on other traffic.
            take = min(len(seq.prompt) - seq.n_past, self._piece(seq.n_past))
            cost = self._piece_cost(seq.n_past, take)
            # the first piece always goes (it was sized to the step); others only if they fit
            if budget <= 0 or (width and budget < cost * (1.0 - 1e-9)):
                break
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
        rows: list[tuple[Sequence, int]] = []
        for seq, part in parts:
            entries.extend(part)
            if part[-1].logits:
                rows.append((seq, len(entries) - 1))
        rc = self.ctx.decode(entries)
        if rc != 0:
            self._fail_step(rc)
            return
        n_prompt = len(entries) - n_decode
        if n_decode:
            self._last_decode_at = started
        self._last_step_decoded = n_decode > 0
        self._advance(entries)
        self.stats.record_step(n_prompt, n_decode)
        now = time.perf_counter()
        for seq, index in rows:
            token = self.ctx.sample(seq.sampler, index)
            self._on_token(seq, token, now)

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

    def _on_token(self, seq: Sequence, token: int, now: float) -> None:
        assert self.model is not None and seq.stop is not None
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.stats.record_ttft(now - seq.enqueued_at)
        seq.generated += 1
        if self.model.is_eog(token):
            self._finish(seq, seq.stop.flush(), "stop")
            return
        text, hit = seq.stop.feed(self.model.piece(token))
        if hit:
            self._finish(seq, text, "stop")
        elif seq.generated >= seq.max_new:
            self._finish(seq, text + seq.stop.flush(), "length")
        else:
            seq.last_token = token
            seq.deliver(GenerationEvent(text=text, completion_tokens=seq.generated))

    def _finish(self, seq: Sequence, text: str, reason: str) -> None:
        seq.deliver(
            GenerationEvent(
                text=text,
                completion_tokens=seq.generated,
                finish_reason=reason,
                prompt_tokens=len(seq.prompt),
                cached_tokens=seq.cached,
            )
        )
        self._service_s = 0.9 * self._service_s + 0.1 * (time.perf_counter() - seq.enqueued_at)
        self._release(seq, keep_prefix=True)

    def _release(self, seq: Sequence, keep_prefix: bool) -> None:
        assert self.ctx is not None
        self._active.remove(seq)
        if keep_prefix:
            self._keep_prefix(seq)
        self.ctx.seq_rm(seq.seq_id)
        heapq.heappush(self._free_ids, seq.seq_id)
        self._reserved -= seq.reserved
        if seq.prefix is not None:
            seq.prefix.refs -= 1
        if seq.sampler is not None:
            llama_cpp.llama_sampler_free(seq.sampler)
            seq.sampler = None

    def _keep_prefix(self, seq: Sequence) -> None:
        """Moves a finished prompt's cells to a prefix entry so later requests can share them."""
        assert self.ctx is not None
        n = len(seq.prompt)
        if not self.settings.prefix_reuse or self.settings.prefix_slots == 0 or n < self.settings.min_prefix_tokens:
            return
        if any(p.scope == seq.scope and _common_prefix(p.tokens, seq.prompt, n) == n for p in self._prefixes):
            return
        if not self._prefix_ids:
            idle = [p for p in self._prefixes if p.refs == 0]
            if not idle:
                return
            self._evict(min(idle, key=lambda p: p.last_used))
        if not self.ctx.per_sequence_streams and self._reserved - seq.reserved + n > self.ctx.n_ctx:
            return
        entry = PrefixEntry(
            seq_id=self._prefix_ids.pop(), tokens=list(seq.prompt), scope=seq.scope, last_used=time.perf_counter()
        )
        self.ctx.copy_prefix(seq.seq_id, entry.seq_id, n)
        self._prefixes.append(entry)
        self._reserved += n

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
            except Exception:  # noqa: BLE001 - the context is freed below anyway
                log.exception("releasing a sequence at shutdown failed")
        self._active = []
        if self.ctx is not None:
            self.ctx.close()


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

