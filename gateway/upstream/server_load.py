"""A member's own account of its load, scraped from its Prometheus endpoint.

The gateway counts only the requests it sent itself; a server shared with other clients (or other
gateway replicas) may be busier than that. Where an upstream names `metrics_url`, its running and
waiting requests and its KV-cache use are read every `metrics_interval_s`:

- vLLM: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
  (`vllm:gpu_cache_usage_perc` before v0.10), both fractions 0..1 despite the name;
- SGLang: `sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`;
- llama.cpp's server (`--metrics`): `llamacpp:requests_processing`, `llamacpp:requests_deferred`,
  `llamacpp:kv_cache_usage_ratio` where the build still reports it.

Samples of one metric are summed over their label sets (one vLLM process may serve several model
names). A reading older than STALE_INTERVALS intervals is not used; a server that stops answering,
or answers something else, leaves the balancer with the gateway's own counts, never an error.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import aiohttp

log = logging.getLogger(__name__)

STALE_INTERVALS = 3.0
MAX_METRICS_BYTES = 4 * 1024 * 1024
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs", "llamacpp:requests_processing")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage", "llamacpp:kv_cache_usage_ratio")
_WANTED = frozenset((*RUNNING, *WAITING, *KV_USAGE))


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """One scrape: requests the server is running and queueing, its KV use (0..1) if it says."""

    running: int
    waiting: int
    kv_usage: float | None
    at: float  # time.monotonic() of the scrape

    @property
    def requests(self) -> int:
        return self.running + self.waiting


def parse(text: str, at: float) -> ServerLoad | None:
    """The load in a Prometheus text exposition, or None where it names none of the known metrics."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name, _, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else line.partition(" ")
        name = name.strip()
        if name not in _WANTED:
            continue
        value_text = rest.rsplit("}", 1)[-1] if "}" in rest else rest
        fields = value_text.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isfinite(value) and value >= 0:
            sums[name] = sums.get(name, 0.0) + value
    running = next((sums[n] for n in RUNNING if n in sums), None)
    waiting = next((sums[n] for n in WAITING if n in sums), None)
    kv = next((sums[n] for n in KV_USAGE if n in sums), None)
    if running is None and waiting is None:
        return None
    return ServerLoad(int(running or 0), int(waiting or 0), None if kv is None else min(1.0, kv), at)


def current(load: ServerLoad | None, interval_s: float, now: float | None = None) -> ServerLoad | None:
    """`load` while it is recent enough to stand for the server's state."""
    if load is None:
        return None
    return load if (now if now is not None else time.monotonic()) - load.at <= STALE_INTERVALS * interval_s else None


async def scrape(session: aiohttp.ClientSession, url: str, timeout_s: float) -> ServerLoad | None:
    """One GET of `url`; None for anything but a readable exposition with a known metric, or one over
    MAX_METRICS_BYTES. Parsed on a worker thread: a vLLM exposition with its histograms runs to
    hundreds of kilobytes, every interval."""
    chunks: list[bytes] = []
    size = 0
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return None
            async for chunk in resp.content.iter_chunked(1 << 16):
                size += len(chunk)
                if size > MAX_METRICS_BYTES:
                    return None
                chunks.append(chunk)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return None
    at = time.monotonic()
    return await asyncio.to_thread(parse, b"".join(chunks).decode("utf-8", "replace"), at)


async def keep_scraping(session: aiohttp.ClientSession, url: str, interval_s: float, store: ScrapeTarget,
                        on_reading: Callable[[ServerLoad], None] | None = None) -> None:
    """Scrape `url` every `interval_s` into `store.server_load` (and `on_reading`: flow control) until cancelled."""
    failing = False
    while True:
        try:
            load = await scrape(session, url, timeout_s=min(interval_s, 2.0))
        except Exception:  # a scrape never ends the scraping, nor surfaces anywhere
            log.exception("%s: reading %s failed", store.name, url)
            load = None
        if load is None and not failing:
            log.info("%s: no load read from %s; balancing on the gateway's own counts", store.name, url)
        failing = load is None
        if load is not None:
            store.server_load = load
            if on_reading is not None:
                on_reading(load)
        await asyncio.sleep(interval_s)


class ScrapeTarget(Protocol):
    """What `keep_scraping` writes to (the pool's Upstream)."""

    server_load: ServerLoad | None

    @property
    def name(self) -> str: ...
