"""Short-request TTFT while a ~1,500-token prompt is prefilled, for several prefill chunk sizes.

Picks the edge engine's default `prefill_chunk`: a request arriving mid-prefill waits for the
chunk in flight, so smaller chunks cut interference and cost the long prompt's own TTFT.
Writes bench/results/edge_prefill_chunk.json. Run: .venv/bin/python bench/edge_prefill_chunk.py
"""

import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._harness import write  # noqa: E402
from edge_engine import EdgeEngine, EdgeSettings, SamplingParams  # noqa: E402

RESULTS: dict[str, dict[str, float]] = {}
LONG = "Summarise this report. " + " ".join(f"Section {i} describes bridge number {i} and its river crossing in detail." for i in range(110))
async def ttft(eng, content, max_tokens=4):
    t = time.perf_counter()
    gen = await eng.submit(messages=[{"role": "user", "content": content}], params=SamplingParams(temperature=0.0, max_tokens=max_tokens))
    first = None
    async for ev in gen:
        if first is None and ev.text: first = time.perf_counter() - t
    return first or (time.perf_counter() - t)
async def run(chunk):
    eng = EdgeEngine(EdgeSettings(n_ctx=2048, n_threads=2, slots=8, prefill_chunk=chunk)); await eng.start()
    await ttft(eng, "hello")
    alone = [await ttft(eng, f"Name a colour number {i}.") for i in range(8)]
    during = []; longs = []
    for r in range(2):
        lt = asyncio.create_task(ttft(eng, LONG + f" Version {r}.", max_tokens=2))
        await asyncio.sleep(0.2)
        while not lt.done():
            during.append(await ttft(eng, f"Name an animal number {r}{len(during)}."))
            await asyncio.sleep(0.1)
        longs.append(await lt)
    await eng.close()
    def q(v: list[float]) -> float:
        return round(sorted(v)[int(0.99 * (len(v) - 1))] * 1000, 1)

    RESULTS[f"chunk_{chunk}"] = {
        "alone_p50_ms": round(statistics.median(alone) * 1000, 1), "alone_p99_ms": q(alone),
        "during_p50_ms": round(statistics.median(during) * 1000, 1), "during_p99_ms": q(during), "during_n": len(during),
        "ratio_p99": round(q(during) / q(alone), 2), "long_ttft_s": round(statistics.median(longs), 2),
    }
    print(f"chunk {chunk}: {RESULTS[f'chunk_{chunk}']}", flush=True)
async def main() -> None:
    for c in (64, 32, 16):
        await run(c)
    load = Path("/proc/loadavg").read_text().split()[:3]
    path = write("edge_prefill_chunk", {"what": __doc__.splitlines()[0], "n_threads": 2, "load_average_end": load,
                                        "target": "short TTFT p99 during prefill <= 2x alone", "results": RESULTS})
    print(f"wrote {path}")


if __name__ == "__main__":
    asyncio.run(main())
