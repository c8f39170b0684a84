"""Prefix cache bookkeeping (no model: a fake context records the copies and removals asked of it).

Whether reused cells give the same greedy text, and scope isolation end to end, are checked
against the real model in test_engine.py.
"""

from __future__ import annotations

from typing import Any

from edge_engine.events import Sequence
from edge_engine.prefix_cache import PrefixCache, common_prefix
from edge_engine.sampling import Priority, SamplingParams

PROMPT = list(range(100, 140))  # 40 tokens


class FakeContext:
    """Records what the cache asks of llama.cpp; `n_ctx` and the stream layout as given."""

    def __init__(self, n_ctx: int = 1024, per_sequence_streams: bool = True) -> None:
        self.n_ctx = n_ctx
        self.per_sequence_streams = per_sequence_streams
        self.calls: list[tuple[Any, ...]] = []

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> None:
        self.calls.append(("seq_rm", seq_id, p0, p1))

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.calls.append(("copy", src, dst, n))


def cache(ctx: FakeContext | None = None, *, slots: int = 2, enabled: bool = True, min_tokens: int = 16) -> PrefixCache:
    # the scheduler's sequence ids are 0..7; prefix entries take the ids after them
    return PrefixCache(ctx or FakeContext(), range(8, 8 + slots), enabled=enabled, min_tokens=min_tokens)


def seq(prompt: list[int], scope: str = "", seq_id: int = 0, n_past: int | None = None) -> Sequence:
    """A running sequence with `n_past` (default: all) of its prompt in the KV cache."""
    s = Sequence(
        prompt=list(prompt), params=SamplingParams(), max_new=8, priority=Priority.INTERACTIVE,
        deliver=lambda _: None, enqueued_at=0.0, scope=scope,
    )
    s.seq_id = seq_id
    s.n_past = len(prompt) if n_past is None else n_past
    s.tokens = s.prompt[: s.n_past]
    return s


def test_a_kept_prompt_is_copied_to_an_id_of_its_own_and_its_cells_counted() -> None:
    ctx = FakeContext()
    c = cache(ctx)
    entry = c.keep(seq(PROMPT, "a", seq_id=3), reserved=0)
    assert entry is not None and entry.seq_id == 9 and entry.tokens == PROMPT and entry.scope == "a"
    assert ctx.calls == [("copy", 3, 9, 40)]
    assert len(c) == 1 and c.entries == (entry,) and c.cells == 40


def test_reuse_never_crosses_scopes() -> None:
    c = cache()
    entry = c.keep(seq(PROMPT, "tenant-a", seq_id=3), reserved=0)
    asking = PROMPT[:30] + [7, 7, 7]
    assert c.best(asking, "tenant-a", []) == (entry, 30)
    assert c.best(asking, "tenant-b", []) == (None, 0)  # an exact guess by another tenant
    assert c.best(PROMPT, "", []) == (None, 0)
    # running sequences of another scope are no source either
    running = seq(PROMPT, "tenant-a", seq_id=4)
    assert c.best(asking, "tenant-b", [running]) == (None, 0)
    assert cache().best(asking, "tenant-a", [running]) == (running, 30)


def test_a_prompt_kept_in_one_scope_is_kept_again_for_another() -> None:
    c = cache()
    assert c.keep(seq(PROMPT, "a"), reserved=0) is not None
    assert c.keep(seq(PROMPT, "a"), reserved=0) is None  # covered already
    assert c.keep(seq(PROMPT[:20], "a"), reserved=0) is None  # a prefix of a kept prompt
    other = c.keep(seq(PROMPT, "b"), reserved=0)
    assert other is not None and len(c) == 2 and c.best(PROMPT, "b", [])[0] is other


def test_at_least_one_prompt_token_is_left_to_compute() -> None:
    c = cache()
    entry = c.keep(seq(PROMPT), reserved=0)
    assert c.best(PROMPT, "", []) == (entry, len(PROMPT) - 1)
    # a running sequence counts only what it has in the KV cache
    assert cache().best(PROMPT, "", [seq(PROMPT, n_past=25)])[1] == 25


def test_short_prompts_and_short_common_prefixes_are_not_shared() -> None:
    c = cache(min_tokens=16)
    assert c.keep(seq(PROMPT[:15]), reserved=0) is None
    c.keep(seq(PROMPT), reserved=0)
    assert c.best(PROMPT[:15] + [1, 2, 3, 4], "", []) == (None, 0)
    assert common_prefix([1, 2, 3], [1, 2, 4], 5) == 2 and common_prefix([1, 2, 3], [1, 2, 3], 1) == 1


def test_of_equal_prefixes_the_smallest_source_is_copied() -> None:
    c = cache()
    c.keep(seq(PROMPT + list(range(500, 560))), reserved=0)
    short = c.keep(seq(PROMPT[:30] + [9] * 10), reserved=0)
    assert c.best(PROMPT[:30] + [1] * 5, "", []) == (short, 30)


def test_a_disabled_cache_keeps_and_finds_nothing() -> None:
    ctx = FakeContext()
    c = cache(ctx, enabled=False)
    assert c.keep(seq(PROMPT), reserved=0) is None
    assert c.best(PROMPT, "", [seq(PROMPT, seq_id=1)]) == (None, 0)
    assert cache(ctx, slots=0).keep(seq(PROMPT), reserved=0) is None
    assert ctx.calls == []


def test_when_ids_run_out_the_least_recently_used_idle_entry_makes_way() -> None:
    ctx = FakeContext()
    c = cache(ctx, slots=2)
    first = c.keep(seq(PROMPT, "a"), reserved=0)
    second = c.keep(seq(PROMPT, "b"), reserved=0)
    assert first is not None and second is not None
    c.borrow(first)
    c.give_back(first)  # used more recently than `second`, and idle again
    third = c.keep(seq(PROMPT, "c", seq_id=5), reserved=0)
    assert third is not None and third.seq_id == second.seq_id  # its id is recycled
    assert c.entries == (first, third) and c.cells == 80
    assert ctx.calls[-2:] == [("seq_rm", second.seq_id, -1, -1), ("copy", 5, second.seq_id, 40)]


def test_an_entry_in_use_is_never_evicted() -> None:
    c = cache(slots=1)
    entry = c.keep(seq(PROMPT, "a"), reserved=0)
    assert entry is not None
    c.borrow(entry)
    assert entry.refs == 1
    assert c.keep(seq(PROMPT, "b"), reserved=0) is None and c.entries == (entry,)
    c.give_back(entry)
    assert entry.refs == 0
    assert c.keep(seq(PROMPT, "b"), reserved=0) is not None and entry not in c.entries


def test_with_a_stream_per_sequence_there_is_always_room() -> None:
    c = cache(FakeContext(n_ctx=64, per_sequence_streams=True))
    c.keep(seq(PROMPT), reserved=0)
    assert c.make_room(1000, reserved=1000) and len(c) == 1


def test_in_a_shared_pool_idle_entries_make_room_least_recently_used_first() -> None:
    ctx = FakeContext(n_ctx=200, per_sequence_streams=False)
    c = cache(ctx, slots=3)
    old = c.keep(seq(PROMPT, "a"), reserved=0)
    new = c.keep(seq(PROMPT, "b"), reserved=0)
    wanted = c.keep(seq(PROMPT, "c"), reserved=0)
    assert old is not None and new is not None and wanted is not None and c.cells == 120
    c.borrow(new)
    c.give_back(new)
    assert c.make_room(60, reserved=20)  # fits: nothing evicted
    assert len(c) == 3
    # one entry must go: `old` is the least recently used but is the one to borrow from,
    # and `new` was borrowed since `wanted` was kept
    assert c.make_room(80, reserved=20, keep=old)
    assert c.entries == (old, new) and c.cells == 80
    assert ctx.calls[-1] == ("seq_rm", wanted.seq_id, -1, -1)


def test_in_a_shared_pool_room_runs_out_when_only_entries_in_use_are_left() -> None:
    c = cache(FakeContext(n_ctx=100, per_sequence_streams=False), slots=2)
    kept = c.keep(seq(PROMPT, "a"), reserved=0)
    idle = c.keep(seq(PROMPT, "b"), reserved=0)
    assert kept is not None and idle is not None
    c.borrow(kept)
    assert not c.make_room(70, reserved=0)
    assert c.entries == (kept,) and c.cells == 40  # the idle one went trying


def test_in_a_shared_pool_a_prompt_is_kept_only_if_its_cells_fit_beside_the_reservations() -> None:
    c = cache(FakeContext(n_ctx=100, per_sequence_streams=False))
    assert c.keep(seq(PROMPT, "a"), reserved=61) is None
    assert c.keep(seq(PROMPT, "a"), reserved=60) is not None and c.cells == 40
