"""LoRA adapters of the edge model served side by side: one small llama.cpp context per resident adapter.

llama.cpp applies an adapter to a context (`llama_set_adapters_lora`), not to a sequence, so a
step cannot mix two adapters. Each resident adapter therefore gets its own context (one sequence,
`n_ctx` cells) on one shared base model: the GGUF is memory-mapped once (the engine's own load of
the same file maps the same pages), and an adapter adds only its own tensors and its context's KV
cells and buffers. Residents are bounded by count and by those bytes (`max_resident`,
`max_memory_bytes`); the least recently used is freed first and loaded again when next asked.

One worker thread runs every adapter call in priority order (interactive before batch, then
arrival), so a template's shadow work never delays a request served locally; the queue is bounded
(`max_queued`) and a full queue refuses at once (EngineBusy) rather than grow. The plain edge
lane's continuous batching (edge_engine.scheduler) is untouched: this runs beside it, on its own
threads.

Two kinds of answer, as the trainer scored them (policies/learn/evaluate.py):

- `choose`: the prompt evaluated once, then each option's tokens after it: every option's summed
  log-probability. Decoding constrained to a label set is exactly this: only a label can come out,
  and the label's own probability among the labels is its confidence.
- `greedy`: the most probable token each step until an end-of-generation token or `max_new`.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import itertools
import logging
import math
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import llama_cpp
import numpy as np

from edge_engine.errors import EngineBusy
from edge_engine.llama_model import BatchEntry, LlamaContext, LlamaModel
from edge_engine.sampling import Priority

log = logging.getLogger(__name__)
T = TypeVar("T")

KV_BYTES = 2  # f16 cells: a key and a value per layer and KV head dimension


@dataclass(frozen=True, slots=True)
class AdapterLimits:
    """What the adapters may hold and queue."""

    n_ctx: int = 1024  # cells of one adapter's context: its longest prompt and answer
    n_batch: int = 256  # tokens per decode step of a prompt
    n_threads: int = 1
    max_resident: int = 4  # adapters loaded at once
    max_memory_bytes: int = 256 * 1024 * 1024  # their tensors and contexts, together
    max_queued: int = 256  # calls waiting for the worker


@dataclass(slots=True)
class _Resident:
    path: Path
    lora: Any
    context: LlamaContext
    bytes: int


@dataclass(frozen=True, slots=True)
class Greedy:
    """A greedy answer: its tokens (no end-of-generation token), their mean log-probability, whether it ended."""

    tokens: list[int]
    mean_logprob: float
    ended: bool


def _logprob(row: np.ndarray, token: int) -> float:
    values = row.astype(np.float64)
    peak = float(values.max())
    return float(values[token] - peak - math.log(float(np.exp(values - peak).sum())))


class AdapterRunner:
    """The base model and its resident adapters; every call runs on one worker thread, by priority."""

    def __init__(self, base: Path, limits: AdapterLimits = AdapterLimits()) -> None:
        self.base = base
        self.limits = limits
        self.model = LlamaModel(base)
        self.kv_bytes_per_token = (
            KV_BYTES
            * 2
            * llama_cpp.llama_model_n_layer(self.model.ptr)
            * llama_cpp.llama_model_n_head_kv(self.model.ptr)
            * (llama_cpp.llama_model_n_embd(self.model.ptr) // max(1, llama_cpp.llama_model_n_head(self.model.ptr)))
        )
        self._residents: OrderedDict[Path, _Resident] = OrderedDict()
        self._queue: queue.PriorityQueue[tuple[int, int, Any]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._closed = False
        self.loads = 0
        self.evictions = 0
        self.calls = 0
        self._thread = threading.Thread(target=self._work, name="edge-adapters", daemon=True)
        self._thread.start()

    # The caller's side.

    def submit(self, priority: Priority, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Queue `fn` for the worker; EngineBusy when `max_queued` calls already wait."""
        if self._closed:
            raise EngineBusy("the adapter runner is closed", retry_after=1.0)
        if self._queue.qsize() >= self.limits.max_queued:
            raise EngineBusy(f"{self.limits.max_queued} adapter calls already wait", retry_after=1.0)
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((int(priority), next(self._order), (fn, future)))
        return future

    def choose(self, adapter: Path, prompt: Sequence[int], options: Sequence[Sequence[int]]) -> list[float]:
        """Each option's summed log-probability after `prompt` (worker thread only: use `submit`)."""
        context = self._context(adapter)
        last = self._prefill(context, prompt)
        out: list[float] = []
        for option in options:
            context.seq_rm(0, len(prompt), -1)
            total = _logprob(last, option[0])
            if len(option) > 1:
                rows = self._decode(context, list(option[:-1]), len(prompt), all_logits=True)
                total += sum(_logprob(row, token) for row, token in zip(rows, option[1:]))
            out.append(total)
        return out

    def greedy(self, adapter: Path, prompt: Sequence[int], max_new: int, stop: frozenset[int]) -> Greedy:
        """The greedy answer after `prompt` (worker thread only: use `submit`)."""
        context = self._context(adapter)
        row = self._prefill(context, prompt)
        tokens: list[int] = []
        logprobs: list[float] = []
        position = len(prompt)
        for _ in range(max_new):
            token = int(np.argmax(row))
            logprobs.append(_logprob(row, token))
            if token in stop or self.model.is_eog(token):
                return Greedy(tokens, float(np.mean(logprobs)), True)
            tokens.append(token)
            if position + 1 >= context.n_ctx:
                break
            row = self._decode(context, [token], position, all_logits=False)[-1]
            position += 1
        return Greedy(tokens, float(np.mean(logprobs)) if logprobs else float("-inf"), False)

    def fits(self, prompt_tokens: int, answer_tokens: int) -> bool:
        return prompt_tokens + answer_tokens < self.limits.n_ctx

    @property
    def resident(self) -> list[dict[str, Any]]:
        return [{"adapter": r.path.name, "bytes": r.bytes} for r in list(self._residents.values())]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put((-1, -1, None))
        self._thread.join(timeout=30)
        for resident in list(self._residents.values()):
            self._free(resident)
        self._residents.clear()
        self.model.close()

    # The worker's side.

    def _work(self) -> None:
        while True:
            _, _, item = self._queue.get()
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                self.calls += 1
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
                future.set_exception(exc)

    def _context(self, adapter: Path) -> LlamaContext:
        found = self._residents.get(adapter)
        if found is not None:
            self._residents.move_to_end(adapter)
            return found.context
        size = adapter.stat().st_size + self.limits.n_ctx * self.kv_bytes_per_token + self.limits.n_batch * self.model.n_vocab * 4
        while self._residents and (
            len(self._residents) >= self.limits.max_resident
            or sum(r.bytes for r in self._residents.values()) + size > self.limits.max_memory_bytes
        ):
            _, oldest = self._residents.popitem(last=False)
            self._free(oldest)
            self.evictions += 1
        lora = llama_cpp.llama_adapter_lora_init(self.model.ptr, str(adapter).encode())
        if not lora:
            raise RuntimeError(f"llama.cpp could not load the adapter {adapter}")
        try:
            context = LlamaContext(self.model, n_ctx=self.limits.n_ctx, n_batch=self.limits.n_batch, n_seq_max=1,
                                   n_threads=self.limits.n_threads, flash_attn=False, per_sequence_streams=False)  # fmt: skip
        except BaseException:
            llama_cpp.llama_adapter_lora_free(lora)
            raise
        adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(lora)
        scales = (ctypes.c_float * 1)(1.0)
        if llama_cpp.llama_set_adapters_lora(context.ptr, adapters, 1, scales) != 0:
            context.close()
            llama_cpp.llama_adapter_lora_free(lora)
            raise RuntimeError(f"llama.cpp could not apply the adapter {adapter}")
        self._residents[adapter] = _Resident(adapter, lora, context, size)
        self.loads += 1
        return context

    @staticmethod
    def _free(resident: _Resident) -> None:
        resident.context.close()
        llama_cpp.llama_adapter_lora_free(resident.lora)

    def _prefill(self, context: LlamaContext, prompt: Sequence[int]) -> np.ndarray:
        """Evaluate the prompt from position 0; the logits after its last token (a copy)."""
        if not prompt or len(prompt) >= context.n_ctx:
            raise ValueError(f"a prompt of {len(prompt)} tokens does not fit {context.n_ctx} cells")
        context.clear()
        return self._decode(context, list(prompt), 0, all_logits=False)[-1]

    def _decode(self, context: LlamaContext, tokens: list[int], start: int, *, all_logits: bool) -> list[np.ndarray]:
        """Decode `tokens` at positions from `start` in steps of n_batch; the logits asked for (copies)."""
        rows: list[np.ndarray] = []
        step = context.n_batch
        for offset in range(0, len(tokens), step):
            piece = tokens[offset : offset + step]
            last = offset + len(piece) == len(tokens)
            entries = [BatchEntry(token=t, pos=start + offset + i, seq_id=0, logits=all_logits or (last and i == len(piece) - 1))
                       for i, t in enumerate(piece)]  # fmt: skip
            status = context.decode(entries)
            if status != 0:
                raise RuntimeError(f"llama_decode failed with status {status}")
            rows.extend(context.logits(i).copy() for i, e in enumerate(entries) if e.logits)
        return rows
