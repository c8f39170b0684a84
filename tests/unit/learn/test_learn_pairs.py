"""The pair store: batches off the loop, the bounds (max_pairs, retention, tenant quota), forgetting,
and what a trainer reads (newest first, a held-out split fixed by the pair's id)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import main
from policies.learn.pairs import FILENAME, PairReader, PairRow, PairStore, held_out, summarize_in

DAY = 86400.0


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def row(i: int, *, tenant: str = "acme", app: str = "support", template: str = "ticket", ts: float = 1_800_000_000.0,
        retention: float = 30 * DAY, max_pairs: int = 5000, quota: int | None = None, answer: str = "billing",
        version: str = "v1") -> PairRow:  # fmt: skip
    return PairRow(
        pair_id=f"{tenant}-{app}-{template}-{i:05d}", tenant=tenant, app=app, template=template, template_version=version,
        matched_by="prefix", ts=ts, expires_at=ts + retention, model="gpt-x",
        messages=json.dumps([{"role": "user", "content": f"ticket {i}"}]), variable=f"ticket {i}", answer=answer,
        params="{}", input_tokens=7, output_tokens=1, max_pairs=max_pairs, tenant_quota_bytes=quota,
    )  # fmt: skip


async def written(store: PairStore, rows: list[PairRow]) -> None:
    for r in rows:
        assert store.add(r)
    await store.flush()


def ids(path: Path, tenant: str = "acme", app: str = "support", template: str = "ticket", **kw: Any) -> list[str]:
    with PairReader(path, wall=kw.pop("wall", Clock())) as reader:
        return [p.pair_id for p in reader.pairs(tenant, app, template, **kw)]


async def test_pairs_are_read_back_newest_first_with_everything_a_trainer_needs(tmp_path: Path) -> None:
    store = PairStore(tmp_path / FILENAME, wall=Clock())
    await store.open()
    await written(store, [row(i) for i in range(5)])
    await store.close()
    with PairReader(tmp_path / FILENAME, wall=Clock()) as reader:
        pairs = list(reader.pairs("acme", "support", "ticket", page=2))  # several pages
        assert [p.pair_id for p in pairs] == [f"acme-support-ticket-{i:05d}" for i in (4, 3, 2, 1, 0)]
        first = pairs[0]
        assert first.messages == [{"role": "user", "content": "ticket 4"}] and first.variable == "ticket 4"
        assert (first.answer, first.model, first.input_tokens, first.output_tokens) == ("billing", "gpt-x", 7, 1)
        assert [(t.template, t.pairs) for t in reader.templates()] == [("ticket", 5)]
        assert list(reader.pairs("acme", "other", "ticket")) == []


async def test_a_template_keeps_its_newest_max_pairs(tmp_path: Path) -> None:
    store = PairStore(tmp_path / FILENAME, wall=Clock())
    await written(store, [row(i, max_pairs=3) for i in range(5)])
    await written(store, [row(i, template="other", max_pairs=3) for i in range(2)])
    assert store.counts == {("acme", "support", "ticket"): 3, ("acme", "support", "other"): 2}
    await store.close()
    assert ids(tmp_path / FILENAME) == [f"acme-support-ticket-{i:05d}" for i in (4, 3, 2)]


async def test_pairs_past_their_retention_are_neither_read_nor_kept(tmp_path: Path) -> None:
    clock = Clock()
    store = PairStore(tmp_path / FILENAME, wall=clock)
    await written(store, [row(0, ts=clock.now - 2 * DAY, retention=DAY), row(1, ts=clock.now, retention=DAY)])
    assert store.counts == {("acme", "support", "ticket"): 1}  # the expired one went with the batch
    clock.now += 2 * DAY  # the other expires while nothing is collected
    assert ids(tmp_path / FILENAME, wall=clock) == []  # never read past its expiry
    await store.close()
    reopened = PairStore(tmp_path / FILENAME, wall=clock)
    await reopened.open()  # swept at start
    assert reopened.counts == {}
    await reopened.close()


async def test_the_tenant_quota_drops_the_tenants_oldest_pairs_only(tmp_path: Path) -> None:
    store = PairStore(tmp_path / FILENAME, wall=Clock())
    await written(store, [row(i, tenant="other") for i in range(3)])
    size = row(0).bytes
    await written(store, [row(i, quota=3 * size, template="a" if i % 2 else "b") for i in range(6)])
    await store.close()
    kept = {t.template: t.pairs for t in summarize_in(tmp_path / FILENAME, "acme", wall=Clock())}
    assert sum(kept.values()) == 3
    assert ids(tmp_path / FILENAME, template="a") == ["acme-support-a-00005", "acme-support-a-00003"]
    assert ids(tmp_path / FILENAME, template="b") == ["acme-support-b-00004"]
    assert len(ids(tmp_path / FILENAME, tenant="other")) == 3


async def test_a_full_queue_drops_pairs_instead_of_blocking(tmp_path: Path) -> None:
    store = PairStore(tmp_path / FILENAME, max_pending=0, wall=Clock())
    assert not store.add(row(0))
    assert store.dropped == 1
    await store.close()
    assert not store.add(row(1))  # closed


async def test_forget_deletes_a_template_of_one_app_one_tenant_or_all(tmp_path: Path) -> None:
    store = PairStore(tmp_path / FILENAME, wall=Clock())
    await written(store, [row(i, tenant=t, app=a) for t in ("acme", "zeta") for a in ("x", "y") for i in range(2)])
    await written(store, [row(0, template="keep")])
    for r in [row(9, tenant="acme", app="x")]:
        store.add(r)  # still queued: forgotten too
    assert await store.forget("ticket", "acme", "x") == 3
    assert await store.forget("ticket", "acme") == 2
    assert await store.forget("ticket") == 4
    assert [(t.tenant, t.template) for t in await store.summary()] == [("acme", "keep")]
    await store.close()


def test_learn_forget_and_learn_list_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import asyncio

    async def fill() -> None:
        store = PairStore(tmp_path / FILENAME)
        await written(store, [row(i, tenant=t) for t in ("acme", "zeta") for i in range(2)])
        await store.close()

    asyncio.run(fill())
    assert main(["edge", "learn-list", "--state-dir", str(tmp_path)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(t["tenant"], t["pairs"]) for t in listed["templates"]] == [("acme", 2), ("zeta", 2)]
    assert main(["edge", "learn-forget", "--template", "ticket", "--tenant", "acme", "--state-dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"] == 2
    assert main(["edge", "learn-forget", "--template", "ticket", "--app", "x", "--state-dir", str(tmp_path)]) == 2
    assert "--app needs --tenant" in capsys.readouterr().err
    assert main(["edge", "learn-forget", "--template", "ticket", "--state-dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"] == 2
    assert main(["edge", "learn-forget", "--template", "ticket", "--state-dir", str(tmp_path / "none")]) == 0


def test_the_held_out_split_is_fixed_by_the_pair_id() -> None:
    names = [f"pair-{i}" for i in range(4000)]
    first = [held_out(n) for n in names]
    assert first == [held_out(n) for n in reversed(names)][::-1]  # the same, in any order
    assert 0.08 < sum(first) / len(first) < 0.12
    assert all(held_out(n, 0.3) for n, out in zip(names, first) if out)  # a larger share keeps the smaller's
    assert not any(held_out(n, 0.0) for n in names) and all(held_out(n, 1.0) for n in names)


async def test_the_reader_splits_and_filters_by_version(tmp_path: Path) -> None:
    store = PairStore(tmp_path / FILENAME, wall=Clock())
    await written(store, [row(i, version="v1" if i < 100 else "v2") for i in range(200)])
    await store.close()
    everything = ids(tmp_path / FILENAME)
    held = ids(tmp_path / FILENAME, split="held_out")
    train = ids(tmp_path / FILENAME, split="train")
    assert sorted(held + train) == sorted(everything) and not set(held) & set(train)
    assert held == [p for p in everything if held_out(p)]
    assert len(ids(tmp_path / FILENAME, version="v1")) == 100
