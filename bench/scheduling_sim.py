"""A GPU fleet in virtual time, scheduled by the gateway's own flow control: what it predicts at 20+ members.

    .venv/bin/python bench/scheduling_sim.py [--members 24] [--slots 16] [--seed 7]   # prints its figures
    .venv/bin/python bench/scheduling.py --simulate                                    # into bench/results/scheduling.json

The CPU fleet of bench/scheduling.py pays for every request it runs beside another (llama.cpp on
shared cores: a decode step of two requests costs about twice one). A GPU's decode step costs
little more for 32 requests than for one, which is where filling idle slots with batch work is
nearly free. This simulates such a fleet: `--members` servers of `--slots` slots each (budgets of 16 in flight), every one a
continuous-batching loop (a step of b requests takes `step_ms * (1 + growth * (b - 1))`, a request
joining adds its prompt's prefill to the step it joins; past its slots a server queues requests
FIFO, as vLLM's waiting queue and llama.cpp's deferred ones do).

In front of it, the scheduler is the gateway's: each member's `Gate` of a `PoolFlow`
(gateway/upstream/flow.py, the very classes the pool uses, with the shipped `FlowSettings`), its
budget the member's slots (`upstreams[].max_concurrency`). Nothing here re-implements the queues'
order, the reserve kept for interactive arrivals or the deadlines: the event loop runs in virtual
time (a selector that advances the clock instead of sleeping), so asyncio's timers, the gates'
futures and the servers' steps run exactly as they would, only without waiting. Placement sends a
request to the member with the fewest requests running and waiting there (the pool's balancer
decides that in the gateway; flow control decides when).

Runs, each on a fresh fleet: (1) interactive alone, Poisson arrivals at a rate keeping the fleet
about 30 % busy; (2) the same arrivals and a batch job's lines sent at once as ordinary requests
(no member budgets: everything goes to the servers' own FIFO queues, as before flow control); (3)
the same arrivals and the job through the Batch API: its runner keeps lines in flight at batch
priority (twice the fleet's slots, at most `batches.concurrency`'s ceiling of 256), and a line refused by flow control (429 upstream_busy) runs again
after its Retry-After; (4) the job alone on an idle fleet (the 1.25x reference). Reported as in
bench/scheduling.py: utilisation (busy slot-seconds over slot-seconds) while the batch has work,
interactive TTFT p50/p99, batch completion and lines per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import selectors
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import pct
from gateway.errors import UpstreamBusy
from gateway.upstream.flow import Gate, PoolFlow
from gateway.upstream.flow_settings import FlowSettings
from policies.domain import Priority


class _VirtualSelector(selectors.SelectSelector):
    """Polls the loop's real file descriptors without blocking; where nothing is ready, moves the clock on by the
    time the loop would have slept (to its next timer)."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("the simulation waits on nothing: no timer is due and no step runs")
        self.clock[0] += timeout + 1e-9
        return ready


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop in virtual time: `time()` is the simulated clock, and sleeping costs nothing."""

    def __init__(self) -> None:
        self._clock = [0.0]
        super().__init__(selector=_VirtualSelector(self._clock))

    def time(self) -> float:
        return self._clock[0]


@dataclass(frozen=True)
class GpuSpec:
    """One member's cost model."""

    slots: int = 32
    step_ms: float = 25.0  # one decode step of one request
    growth: float = 0.004  # a step of b requests costs step_ms * (1 + growth * (b - 1)): 1.12x at 32
    prefill_ms_per_token: float = 0.05  # a joining request's prompt, added to the step it joins

    def step_s(self, batch: int, prefill_tokens: int) -> float:
        return (self.step_ms * (1 + self.growth * (batch - 1)) + self.prefill_ms_per_token * prefill_tokens) / 1000


@dataclass(eq=False)
class _Run:
    """A request on a member: waiting in its FIFO queue, then in its running batch."""

    prompt: int
    left: int  # tokens still to produce
    done: asyncio.Future[None]
    prefilled: bool = False
    first_token_at: float | None = None


class Member:
    """A continuous-batching server: at most `slots` requests per step, the rest in its FIFO queue."""

    def __init__(self, name: str, spec: GpuSpec, gate: Gate | None, meter: Meter) -> None:
        self.name = name
        self.spec = spec
        self.gate = gate
        self.meter = meter
        self.running: list[_Run] = []
        self.queued: deque[_Run] = deque()
        self._wake = asyncio.Event()

    def load(self) -> int:
        """Requests running, queued here and waiting for this member in the gateway (placement's measure)."""
        waiting = sum(len(q) for q in self.gate.queues.values()) if self.gate is not None else 0
        return len(self.running) + len(self.queued) + waiting

    def submit(self, run: _Run) -> None:
        self.queued.append(run)
        self._wake.set()

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while self.queued and len(self.running) < self.spec.slots:
                self.running.append(self.queued.popleft())
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = len(self.running)
            prefill = sum(r.prompt for r in self.running if not r.prefilled)
            step = self.spec.step_s(batch, prefill)
            start = loop.time()
            await asyncio.sleep(step)
            self.meter.busy(start, loop.time(), batch)
            now = loop.time()
            for run in list(self.running):
                if not run.prefilled:
                    run.prefilled, run.first_token_at = True, now
                run.left -= 1
                if run.left <= 0:
                    self.running.remove(run)
                    run.done.set_result(None)


@dataclass
class Meter:
    """Busy slot-seconds per second of virtual time (what a server's counters give, integrated)."""

    bins: dict[int, float] = field(default_factory=dict)

    def busy(self, start: float, end: float, batch: int) -> None:
        t = start
        while t < end:
            edge = min(end, float(int(t) + 1))
            self.bins[int(t)] = self.bins.get(int(t), 0.0) + batch * (edge - t)
            t = edge

    def between(self, start: float, end: float) -> float:
        """Busy slot-seconds in [start, end) (whole seconds; the run's windows are tens of seconds long)."""
        return sum(v for k, v in self.bins.items() if start <= k < end)


@dataclass
class Outcome:
    priority: str
    arrived: float
    ttft_s: float | None
    done_at: float
    refusals: int  # 429s it met before it was answered


class Fleet:
    def __init__(self, members: int, spec: GpuSpec, flow: FlowSettings | None) -> None:
        self.spec = spec
        self.meter = Meter()
        self.pool = PoolFlow("sim", flow, clock=asyncio.get_running_loop().time) if flow is not None else None
        self.members = [
            Member(f"gpu{i}", spec, self.pool.gate(f"gpu{i}", spec.slots, 5.0) if self.pool else None, self.meter)
            for i in range(members)
        ]
        self._tasks = [asyncio.get_running_loop().create_task(m.serve()) for m in self.members]
        self._turn = 0

    def place(self) -> Member:
        self._turn += 1
        n = len(self.members)
        return min((self.members[(self._turn + i) % n] for i in range(n)), key=Member.load)

    async def ask(self, priority: Priority, tenant: str, prompt: int, output: int, retry: bool) -> Outcome:
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        refusals = 0
        while True:
            member = self.place()
            slot = None
            if member.gate is not None:
                try:
                    slot = await member.gate.acquire(priority, tenant)
                except UpstreamBusy as busy:
                    refusals += 1
                    if not retry:
                        return Outcome(priority, arrived, None, loop.time(), refusals)
                    await asyncio.sleep(busy.retry_after or 1.0)
                    continue
            run = _Run(prompt, output, loop.create_future())
            try:
                member.submit(run)
                await run.done
            finally:
                if slot is not None:
                    slot.release()
            assert run.first_token_at is not None
            return Outcome(priority, arrived, run.first_token_at - arrived, loop.time(), refusals)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


@dataclass(frozen=True)
class Workload:
    seed: int
    rate: float  # interactive arrivals per second
    duration_s: float
    lines: int
    interactive_prompt: tuple[int, int] = (400, 1200)
    interactive_output: tuple[int, int] = (100, 300)
    line_prompt: tuple[int, int] = (300, 700)
    line_output: tuple[int, int] = (100, 300)

    def arrivals(self) -> list[tuple[float, int, int]]:
        rng = random.Random(self.seed)
        out: list[tuple[float, int, int]] = []
        t = 0.0
        while True:
            t += rng.expovariate(self.rate)
            if t >= self.duration_s:
                return out
            out.append((t, rng.randint(*self.interactive_prompt), rng.randint(*self.interactive_output)))

    def batch(self) -> list[tuple[int, int]]:
        rng = random.Random(self.seed + 1)
        return [(rng.randint(*self.line_prompt), rng.randint(*self.line_output)) for _ in range(self.lines)]

    def mean_interactive_slot_s(self, spec: GpuSpec) -> float:
        """A lone interactive request's expected time in a slot (its prefill step and its decode steps)."""
        prompt, output = sum(self.interactive_prompt) / 2, sum(self.interactive_output) / 2
        return spec.step_s(1, int(prompt)) + (output - 1) * spec.step_s(1, 0)


async def _run(members: int, spec: GpuSpec, work: Workload, mode: str, runner_concurrency: int) -> dict[str, Any]:
    """One run on a fresh fleet: mode alone | naive | flow | batch_alone."""
    loop = asyncio.get_running_loop()
    fleet = Fleet(members, spec, None if mode == "naive" else FlowSettings())
    outcomes: list[Outcome] = []
    lines: list[Outcome] = []

    async def person(at: float, prompt: int, output: int) -> None:
        await asyncio.sleep(at)
        outcomes.append(await fleet.ask("interactive", f"person-{len(outcomes) % 64}", prompt, output, retry=False))

    async def runner(todo: deque[tuple[int, int]]) -> None:
        while todo:
            prompt, output = todo.popleft()
            lines.append(await fleet.ask("batch", "batch-owner", prompt, output, retry=True))

    async def naive_line(prompt: int, output: int) -> None:
        lines.append(await fleet.ask("interactive", "batch-owner", prompt, output, retry=True))

    tasks: list[asyncio.Task[None]] = []
    if mode != "batch_alone":
        tasks += [loop.create_task(person(*a)) for a in work.arrivals()]
    if mode == "naive":
        tasks += [loop.create_task(naive_line(*line)) for line in work.batch()]
    elif mode in ("flow", "batch_alone"):
        todo = deque(work.batch())
        tasks += [loop.create_task(runner(todo)) for _ in range(runner_concurrency)]
    await asyncio.gather(*tasks)
    fleet.close()
    end = max([o.done_at for o in outcomes + lines], default=0.0)
    batch_end = max((o.done_at for o in lines), default=None)
    window = batch_end if batch_end is not None else work.duration_s
    slots = members * spec.slots
    ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    during = [o.ttft_s for o in outcomes if o.ttft_s is not None and batch_end is not None and o.arrived < batch_end]
    out: dict[str, Any] = {
        "utilisation": round(fleet.meter.between(0, int(window)) / (slots * int(window)), 4) if window >= 1 else None,
        "utilisation_window_s": int(window),
        "interactive_requests": len(outcomes),
        "interactive_refused": sum(1 for o in outcomes if o.ttft_s is None),
        "interactive_ttft_p50_ms": round(pct(ttft, 0.5) * 1000, 1) if ttft else None,
        "interactive_ttft_p99_ms": round(pct(ttft, 0.99) * 1000, 1) if ttft else None,
        "simulated_s": round(end, 1),
    }
    if lines:
        assert batch_end is not None
        out.update(
            {
                "interactive_during_batch": len(during),
                "interactive_during_batch_ttft_p99_ms": round(pct(during, 0.99) * 1000, 1) if during else None,
                "batch_lines": len(lines),
                "batch_completion_s": round(batch_end, 2),
                "batch_lines_per_s": round(len(lines) / batch_end, 2),
                "batch_refusals": sum(o.refusals for o in lines),
            }
        )
    return out


def simulate(
    members: int = 24,
    slots: int = 16,
    seed: int = 7,
    busy: float = 0.3,
    duration_s: float = 240.0,
    lines: int | None = None,
    runner_concurrency: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every run of the simulation, and the ratios the targets name."""
    spec = GpuSpec(slots=slots)
    probe = Workload(seed, 1.0, duration_s, 0)
    rate = busy * members * slots / probe.mean_interactive_slot_s(spec)
    # the job: about 60 % of the fleet for 60 % of the run on its own (it finishes inside the arrivals' span)
    line_slot_s = GpuSpec(slots=slots).step_s(1, 500) + 199 * spec.step_s(1, 0)
    n_lines = lines if lines is not None else int(0.6 * duration_s * 0.6 * members * slots / line_slot_s)
    work = Workload(seed, rate, duration_s, n_lines)
    # the runner's ceiling (batches.concurrency at most 256): one gateway's job keeps no more lines in flight
    concurrency = runner_concurrency if runner_concurrency is not None else min(256, 2 * members * slots)
    runs: dict[str, Any] = {}
    for mode in ("alone", "naive", "flow", "batch_alone"):
        started = time.perf_counter()
        loop = VirtualLoop()
        try:
            runs[mode] = loop.run_until_complete(_run(members, spec, work, mode, concurrency))
        finally:
            loop.close()
        if progress is not None:
            progress(f"simulated {mode}: {runs[mode]} ({time.perf_counter() - started:.1f} s)")
    alone, naive, flow, idle = runs["alone"], runs["naive"], runs["flow"], runs["batch_alone"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    return {
        "fleet": {
            "members": members,
            "slots_per_member": slots,
            "step_ms": spec.step_ms,
            "step_growth_per_request": spec.growth,
            "step_at_full_batch_x": round(spec.step_s(slots, 0) / spec.step_s(1, 0), 3),
            "prefill_ms_per_token": spec.prefill_ms_per_token,
        },
        "workload": {
            "interactive_rate_per_s": round(rate, 2),
            "target_busy": busy,
            "duration_s": duration_s,
            "batch_lines": n_lines,
            "runner_concurrency": concurrency,
            "seed": seed,
            "interactive_prompt_tokens": list(work.interactive_prompt),
            "interactive_output_tokens": list(work.interactive_output),
            "line_prompt_tokens": list(work.line_prompt),
            "line_output_tokens": list(work.line_output),
        },
        "flow_settings": {
            **FlowSettings().model_dump(include={"interactive_headroom", "headroom_miss", "headroom_window_s",
                                                 "headroom_idle_s"}),
            "member_budget": slots,
        },
        "runs": runs,
        "predicted": {
            "utilisation_alone": alone["utilisation"],
            "utilisation_with_batch": flow["utilisation"],
            "interactive_ttft_p99_ms_alone": alone["interactive_ttft_p99_ms"],
            "interactive_ttft_p99_ms_with_batch": flow["interactive_during_batch_ttft_p99_ms"],
            "interactive_ttft_p99_ms_naive": naive["interactive_during_batch_ttft_p99_ms"],
            "ttft_p99_ratio_vs_alone": ratio(flow["interactive_during_batch_ttft_p99_ms"], alone["interactive_ttft_p99_ms"]),
            "ttft_p99_ratio_vs_naive": ratio(
                flow["interactive_during_batch_ttft_p99_ms"], naive["interactive_during_batch_ttft_p99_ms"]
            ),
            "batch_completion_ratio_vs_alone": ratio(flow["batch_completion_s"], idle["batch_completion_s"]),
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=24)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--duration", type=float, default=240.0, help="seconds of interactive arrivals (simulated)")
    args = parser.parse_args()
    data = simulate(
        args.members,
        args.slots,
        args.seed,
        duration_s=args.duration,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
