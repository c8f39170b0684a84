"""Whether the edge model is calibrated, and its calibration in the background when asked for.

At start the edge model file's sha256 is compared with the calibration artifacts that may describe
it (policies/edge_quality/lookup.py). Without one made for this very file the edge lane takes no
`auto` traffic (the route stage asks `Cascade.calibrated`); requests that name the edge model are
still answered. `/readyz` reports the state under `checks.edge_calibration`; it never makes the
gateway unready.

With `edge.calibrate_on_start` on, a missing calibration is made after start: the probe set runs
on the serving engine (queued behind its requests), hashing, embedding and fitting run in a worker
thread, the artifact is written to the per-digest cache, and the cascade takes it up: the edge
takes `auto` traffic from then on, without a restart. A failure is logged and reported (`failed`);
the edge then stays off `auto` traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from policies.edge_quality.lookup import Lookup, cache_root, find_calibration, publish_artifact, staging_dir

if TYPE_CHECKING:
    from edge_engine import EdgeEngine
    from gateway.settings import EdgeSettingsModel
    from policies.edge_quality.model import EdgeCalibration

log = logging.getLogger(__name__)

State = Literal["missing", "calibrating", "ready", "failed"]
HINT = "calibrate it with `tierlane edge calibrate --model {model}` (or set edge.calibrate_on_start: background)"


@dataclass(slots=True)
class EdgeCalibrationStatus:
    """What /readyz says of the edge model's calibration."""

    state: State
    model_path: str
    model_sha256: str
    source: str | None = None  # where the artifact in use came from: named, shipped, cache or calibrated
    directory: str | None = None
    error: str | None = None
    probes_done: int = 0
    probes_total: int = 0
    refused: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "calibration": self.state,
            "auto_traffic": self.state == "ready",
            "model_sha256": self.model_sha256,
            "model_file": Path(self.model_path).name,
        }
        if self.directory is not None:
            out["artifact"] = self.directory
            out["source"] = self.source
        if self.state == "calibrating":
            out["probes"] = {"done": self.probes_done, "total": self.probes_total}
        if self.error is not None:
            out["error"] = self.error
        return out


async def find_for_model(edge: EdgeSettingsModel, named: str | None) -> tuple[EdgeCalibration | None, EdgeCalibrationStatus]:
    """The calibration of the configured edge model (hashing it off the loop, once per file version), logged."""
    resolved = await asyncio.to_thread(edge.resolved_model)  # hashed once per file version, remembered
    model = resolved.path
    lookup: Lookup = await asyncio.to_thread(
        find_calibration, model, named=named, cache_dir=edge.calibration_cache, model_sha256=resolved.sha256)
    if lookup.calibration is not None:
        status = EdgeCalibrationStatus("ready", str(model), lookup.model_sha256, lookup.source,
                                       str(lookup.directory) if lookup.directory else None)
        log.info("edge model %s (sha256 %s) is calibrated (%s artifact %s): it takes auto traffic",
                 model.name, lookup.model_sha256[:12], lookup.source, lookup.directory)
        return lookup.calibration, status
    background = bool(edge.calibrate_on_start)
    status = EdgeCalibrationStatus("calibrating" if background else "missing", str(model), lookup.model_sha256,
                                   refused=lookup.refused)
    log.warning(
        "edge model %s (sha256 %s) has no calibration of its own (%s): the edge lane takes no auto traffic, only "
        "requests naming it%s",
        model.name, lookup.model_sha256[:12], "; ".join(lookup.refused) or "none found",
        "; calibrating it in the background now" if background else "; " + HINT.format(model=model),
    )
    return None, status


class BackgroundCalibration:
    """`tierlane edge calibrate` run inside the gateway on its serving engine (edge.calibrate_on_start)."""

    def __init__(self, status: EdgeCalibrationStatus, edge: EdgeSettingsModel,
                 on_ready: Callable[[EdgeCalibration], None]) -> None:
        self.status = status
        self.edge = edge
        self.on_ready = on_ready  # takes the calibration up (the cascade's), on the event loop
        self._task: asyncio.Task[None] | None = None

    def start(self, engine: EdgeEngine) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(engine), name="edge-calibration")

    async def _run(self, engine: EdgeEngine) -> None:
        from policies.edge_quality.calibrate import CalibrationConfig, calibrate_async
        from policies.edge_quality.model import EdgeCalibration

        status, edge = self.status, self.edge
        digest = status.model_sha256
        root = cache_root(edge.calibration_cache)
        staged: Path | None = None
        status.state, status.error = "calibrating", None
        log.info("edge calibration of %s (sha256 %s) started: at most %g s of probing", Path(status.model_path).name,
                 digest[:12], edge.calibrate_budget_s)
        try:
            staged = await asyncio.to_thread(staging_dir, digest, edge.calibration_cache)
            config = CalibrationConfig(
                model_path=Path(status.model_path), out=staged, limit=edge.calibrate_limit,
                concurrency=min(edge.calibrate_concurrency, edge.slots), budget_s=edge.calibrate_budget_s,
                min_probes=edge.calibrate_min_probes, cache=root / "records" / f"{digest}.jsonl",
            )
            await calibrate_async(config, progress=self._progress, total=self._total, engine=engine, model_sha256=digest)
            directory = await asyncio.to_thread(publish_artifact, staged, digest, edge.calibration_cache)
            staged = None
            calibration = await asyncio.to_thread(EdgeCalibration.load, directory)
            if calibration.gguf_sha256 != digest:
                raise RuntimeError(f"the artifact written to {directory} describes another model")
        except asyncio.CancelledError:
            status.state, status.error = "failed", "cancelled (the gateway stopped)"
            raise
        except Exception as exc:  # any failure leaves the edge uncalibrated and reported, the gateway running
            log.exception("edge calibration of %s failed; the edge lane keeps taking no auto traffic",
                          Path(status.model_path).name)
            status.state, status.error = "failed", f"{type(exc).__name__}: {exc}"
            return
        finally:
            if staged is not None:
                await asyncio.to_thread(shutil.rmtree, staged, True)
        self.on_ready(calibration)
        status.state, status.source, status.directory = "ready", "calibrated", str(directory)
        log.info("edge calibration done (%d probes): artifact %s; the edge lane now takes auto traffic",
                 status.probes_done, directory)

    def _progress(self, n: int) -> None:
        status = self.status
        status.probes_done += n
        # a line per tenth of the run: the log is the background run's progress bar
        step = max(1, status.probes_total // 10)
        if status.probes_done // step != (status.probes_done - n) // step:
            log.info("edge calibration: %d of %d probes", status.probes_done, status.probes_total)

    def _total(self, n: int) -> None:
        self.status.probes_total = n

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
