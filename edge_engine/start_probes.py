"""The engine's start probes (prompt step cost, draft cost), timed once and kept for later starts.

Timing them takes seconds on a small CPU (~5 s on one thread: most of it a 512-cell scratch
prompt), paid on every start, so every restart and every replica that scales out waited for
it. The fitted costs are kept in a small JSON file per model file, llama.cpp build, CPU and the
settings that shape the probes, and reused while younger than `probe_cache_ttl_s`. They only
size prompt steps and drafts (never what greedy decoding produces), and a start that cannot
read or write the file times the probes as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge_engine.llama_model import LlamaContext, LlamaModel
from edge_engine.speculative import DraftCost
from edge_engine.step_cost import StepCost

log = logging.getLogger(__name__)

_VERSION = 1  # of what is kept; a new layout or probe method changes it


@dataclasses.dataclass(frozen=True, slots=True)
class StartCosts:
    steps: StepCost
    draft: DraftCost | None  # None: speculation off, not timed


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _fingerprint(path: Path, edge: int = 1 << 20) -> tuple[int, str]:
    """The file's size and a digest of its first and last MiB (a GGUF's header and metadata, its last
    tensors): another model file differs there, a copy does not (an image layer rounds mtimes)."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        digest.update(fh.read(edge))
        if size > 2 * edge:
            fh.seek(size - edge)
            digest.update(fh.read(edge))
    return size, digest.hexdigest()[:16]


def probe_key(model: LlamaModel, ctx: LlamaContext, settings: Any, speculate: bool) -> str:
    """What the probes' results depend on: the model file, llama.cpp's build, the CPU, the context's shape."""
    import llama_cpp

    parts = {
        "version": _VERSION,
        "model": [str(Path(model.path).resolve()), *_fingerprint(Path(model.path))],
        "llama_cpp": getattr(llama_cpp, "__version__", "?"),
        "cpu": [_cpu(), os.cpu_count()],
        "n_ctx": ctx.n_ctx,
        "n_batch": ctx.n_batch,
        "shape": [settings.n_threads, settings.flash_attn, settings.kv_cache_type, settings.batch_invariant,
                  settings.n_gpu_layers, settings.extra_buffers, settings.n_seq_max],  # fmt: skip
        "steps": [settings.prefill_step_ms, settings.prefill_chunk],
        "speculate": speculate,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _read(path: Path, ttl_s: float, now: float) -> StartCosts | None:
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
        if kept.get("version") != _VERSION or not 0 <= now - float(kept["measured_at"]) <= ttl_s:
            return None
        draft = kept.get("draft")
        return StartCosts(StepCost(**kept["steps"]), DraftCost(**draft) if draft is not None else None)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as exc:  # damaged or foreign: timed again and replaced
        log.warning("edge start probes: ignoring %s (%s)", path, exc)
        return None


def _write(path: Path, costs: StartCosts, now: float) -> None:
    kept = {
        "version": _VERSION,
        "measured_at": now,
        "steps": dataclasses.asdict(costs.steps),
        "draft": dataclasses.asdict(costs.draft) if costs.draft is not None else None,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(kept, f)
        os.chmod(tmp, 0o644)  # mkstemp's 0600: an image times them as root, its gateway runs as another user
        os.replace(tmp, path)  # atomic: replicas starting together read a whole file or none
    except OSError as exc:  # a read-only home: timed again at the next start
        log.info("edge start probes: not kept (%s)", exc)


def start_costs(
    ctx: LlamaContext,
    model: LlamaModel,
    scratch_seq_id: int,
    settings: Any,
    *,
    speculate: bool,
    clock: Callable[[], float] = time.time,
) -> StartCosts:
    """The step and draft costs for this context: kept ones when fresh, else timed now (and kept).

    Must run on the scheduler thread (the probes decode on `scratch_seq_id`, which must be free).
    """
    directory = settings.probe_cache_dir
    path = None
    if directory:
        path = Path(directory).expanduser() / f"start-probes-{probe_key(model, ctx, settings, speculate)}.json"
        kept = _read(path, settings.probe_cache_ttl_s, clock())
        if kept is not None:
            log.info("edge start probes: reused %s (%s)", path.name, kept)
            return kept
    steps = StepCost.calibrate(
        ctx, model, scratch_seq_id, step_ms=settings.prefill_step_ms, max_tokens=settings.prefill_chunk
    )
    draft = DraftCost.calibrate(ctx, model, scratch_seq_id) if speculate else None
    costs = StartCosts(steps, draft)
    if path is not None and (steps.modelled or settings.prefill_step_ms is None):  # a failed probe is not kept
        _write(path, costs, clock())
    return costs
