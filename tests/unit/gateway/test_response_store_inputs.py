"""The SQLite response store keeps each input once per tenant and content, and migrates a schema-1 file."""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

import orjson

from gateway.apis.response_store import SqliteResponseStore, Usage

BIG = "z" * 100_000


def record(rid: str, text: str = BIG) -> dict[str, Any]:
    return {"response": {"id": rid, "output": [{"type": "message", "content": "ok"}]},
            "input": [{"type": "message", "role": "user", "content": text}], "previous": None, "session": None}


def rows(path, sql: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return list(conn.execute(sql))
    finally:
        conn.close()


def test_identical_inputs_are_kept_once_per_tenant_counted_once_and_deleted_with_the_last(tmp_path):
    path = tmp_path / "r.sqlite3"

    async def run() -> None:
        store = SqliteResponseStore(path, ttl_s=60)
        await store.start()
        try:
            for i in range(5):
                await store.put("a", f"resp_{i}", record(f"resp_{i}"))
            await store.put("b", "resp_b", record("resp_b"))  # the same input, another tenant: its own copy
            used = await store.usage("a")
            assert used.records == 5 and len(BIG) < used.bytes < 2 * len(BIG), used
            assert await store.get("a", "resp_3") == record("resp_3")
        finally:
            await store.close()
        assert rows(path, "SELECT tenant, COUNT(*) FROM inputs GROUP BY tenant") == [("a", 1), ("b", 1)]
        assert sum(n for (n,) in rows(path, "SELECT LENGTH(record) FROM responses")) < len(BIG)
        reopened = SqliteResponseStore(path, ttl_s=60)
        await reopened.start()
        try:
            assert await reopened.usage("a") == used  # counted again from the file: the same figure
            for i in range(4):  # an input another record still names is kept
                assert await reopened.delete("a", f"resp_{i}")
                assert await reopened.get("a", "resp_4") == record("resp_4")
            assert (await reopened.usage("a")).bytes > len(BIG)
            assert await reopened.delete("a", "resp_4")
            assert await reopened.usage("a") == Usage(0, 0)
            assert await reopened.get("b", "resp_b") == record("resp_b")
        finally:
            await reopened.close()
        assert rows(path, "SELECT tenant FROM inputs") == [("b",)]

    asyncio.run(run())


def test_a_schema_1_file_is_migrated_and_its_records_still_read(tmp_path):
    path = tmp_path / "r.sqlite3"
    old = {"response": {"id": "resp_old"}, "input": [{"role": "user", "content": BIG}], "previous": None}
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE responses (tenant TEXT NOT NULL, id TEXT NOT NULL, expires REAL NOT NULL, "
                 "record BLOB NOT NULL, PRIMARY KEY (tenant, id))")
    conn.execute("CREATE INDEX responses_expires ON responses (expires)")
    conn.execute("INSERT INTO responses VALUES (?, ?, ?, ?)", ("a", "resp_old", 4e9, orjson.dumps(old)))
    conn.commit()
    conn.close()

    async def run() -> None:
        for _ in range(2):  # migrated once; opened again as it is
            store = SqliteResponseStore(path, ttl_s=60)
            await store.start()
            try:
                assert await store.get("a", "resp_old") == old
                assert (await store.usage("a")).records >= 1
                await store.put("a", "resp_new", record("resp_new"))
                assert await store.get("a", "resp_new") == record("resp_new")
            finally:
                await store.close()
        store = SqliteResponseStore(path, ttl_s=60)
        await store.start()
        try:
            used = await store.usage("a")
            assert used.records == 2 and used.bytes < len(orjson.dumps(old)) + len(BIG) + 2000
            assert await store.delete("a", "resp_old") and await store.get("a", "resp_new") == record("resp_new")
        finally:
            await store.close()

    asyncio.run(run())
    assert rows(path, "PRAGMA user_version") == [(2,)]
    assert rows(path, "SELECT COUNT(*) FROM inputs") == [(1,)]




def test_the_sweep_of_expired_records_takes_their_inputs_and_counts_again(tmp_path, monkeypatch):
    from gateway.apis import response_store

    class Clock:
        now = 1_000_000.0

        def time(self) -> float:
            return self.now

    clock = Clock()
    monkeypatch.setattr(response_store, "time", clock)
    path = tmp_path / "r.sqlite3"

    async def run() -> None:
        store = SqliteResponseStore(path, ttl_s=10)
        await store.start()
        try:
            for i in range(3):
                await store.put("a", f"resp_{i}", record(f"resp_{i}"))
            clock.now += 20
            store.ttl_s = 1000
            for i in range(300):  # a sweep comes every 256 writes
                await store.put("c", f"resp_{i}", {"x": i})
            while store._flushing is not None:
                await store._flushing
            assert await store.usage("a") == Usage()
        finally:
            await store.close()
        assert rows(path, "SELECT tenant FROM inputs") == []

    asyncio.run(run())
