"""`tierlane edge pull`: puts the model `edge.model` names on this machine, verified, before the gateway starts.

A hub file (`hf://org/repo[@revision]/file.gguf`) is downloaded once into the model cache with a
progress bar, resumed where an earlier pull stopped, and kept only when its sha256 is the one
`edge.model_sha256` pins; a second pull finds it there and downloads nothing. For the bundled model
or a local path there is nothing to download: the file is checked (against its pin, if any).
HF_HUB_OFFLINE does not stop this command: it is the set-up step. The gateway itself never downloads.

Exit status: 0 the model is in place; 1 it could not be downloaded or is not the pinned file; 2 the
settings are wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from edge_engine.model_pull import GIB, PullLimits

    # NOTE: `tierlane edge` is registered by policies.edge_quality.cli (calibrate, probe); `pull` joins it.
    edge = subparsers.choices.get("edge") or subparsers.add_parser("edge", help="the local edge model")
    actions = [a for a in edge._actions if isinstance(a, argparse._SubParsersAction)]
    sub = actions[0] if actions else edge.add_subparsers(dest="edge_command", metavar="ACTION", required=True)
    pull = sub.add_parser(
        "pull", help="download the hub GGUF edge.model names into the model cache and verify its sha256 (set-up step)"
    )
    pull.add_argument("--config", help="YAML settings file (default: $TIERLANE_CONFIG or the embedded defaults)")
    pull.add_argument("--retries", type=int, default=3, help="a lost connection is resumed this many times (default 3)")
    pull.add_argument("--timeout-s", type=float, default=60.0, help="longest wait for the server, per read (default 60)")
    limits = PullLimits()
    pull.add_argument("--max-gb", type=float, default=limits.max_bytes / GIB,
                      help="the largest file taken, in GiB, where the hub lists no size for the pinned digest: a body "
                           f"past it is cut and deleted (default {limits.max_bytes / GIB:g})")
    pull.add_argument("--max-time-s", type=float, default=limits.max_time_s,
                      help=f"longest the whole pull may take; 0: no bound (default {limits.max_time_s:g})")
    pull.add_argument("--min-rate-kib", type=float, default=limits.min_rate_kib,
                      help=f"the pull stops when fewer KiB/s than this arrive over {limits.rate_window_s:g} s; "
                           f"0: no minimum (default {limits.min_rate_kib:g})")
    pull.set_defaults(func=_pull)


def _fail(message: str, code: int) -> int:
    print(f"tierlane edge pull: {message}", file=sys.stderr, flush=True)
    return code


def _report(**fields: Any) -> int:
    print(json.dumps(fields, indent=1))
    return 0


def _pull(args: argparse.Namespace) -> int:
    from edge_engine.model_pull import GIB, DigestMismatch, PullError, PullLimits, pull
    from edge_engine.model_source import ModelUnavailable, parse_model
    from gateway.settings import Settings, hub_token

    try:
        settings = Settings.load(args.config)
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        return _fail(f"the settings do not load: {exc}", 2)
    edge = settings.edge
    source = parse_model(edge.model)
    hub = source.hub
    if hub is None:
        # The bundled model or a path: nothing to download; check it as the gateway will at start
        # (a path's digest is reported, for an image layer to pin; the bundled one is not hashed).
        try:
            if source.kind == "bundled":
                return _report(model=edge.model, path=str(edge.resolved_model_path()), pulled=False)
            resolved = edge.resolved_model()
        except ModelUnavailable as exc:
            return _fail(str(exc), 1)
        return _report(model=edge.model, path=str(resolved.path), sha256=resolved.sha256, pulled=False)
    assert edge.model_sha256 is not None  # the settings refuse a hub file without its pin
    if not args.max_gb > 0 or args.max_time_s < 0 or args.min_rate_kib < 0:
        return _fail("--max-gb must be above 0, --max-time-s and --min-rate-kib 0 or above", 2)
    limits = PullLimits(max_bytes=int(args.max_gb * GIB), max_time_s=args.max_time_s, min_rate_kib=args.min_rate_kib)
    bar = _ProgressBar(hub.file)
    try:
        result = pull(
            hub, edge.model_sha256, edge.model_cache_dir, endpoint=edge.hub_endpoint, token=hub_token(),
            retries=max(0, args.retries), timeout_s=args.timeout_s, limits=limits, progress=bar.follow,
        )
    except DigestMismatch as exc:
        return _fail(f"refused: {exc}", 1)
    except PullError as exc:
        return _fail(str(exc), 1)
    except OSError as exc:
        return _fail(f"cannot write the model cache: {exc}", 1)
    finally:
        bar.close()
    return _report(
        model=hub.spec, path=str(result.path), sha256=result.sha256, pulled=not result.already_there,
        downloaded_bytes=result.downloaded, resumed_from=result.resumed_from,
    )


class _ProgressBar:
    """A tqdm byte bar that follows the part file (its size known from the first response)."""

    def __init__(self, name: str) -> None:
        from tqdm import tqdm

        self._bar = tqdm(desc=name, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, total=None)

    def follow(self, done: int, total: int | None) -> None:
        if total is not None and self._bar.total != total:
            self._bar.total = total
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        self._bar.close()
