"""The probe set: reproducible from its seed, two splits that share no item, phrasing held out."""

from __future__ import annotations

import json
from collections import Counter

from policies.edge_quality.probes import (
    ARC_FILE,
    DEFAULT_SEED,
    FAMILIES,
    PER_FAMILY,
    Probe,
    default_probes_path,
    generate_probes,
    load_probes,
    package_dir,
    probe_set_hash,
)


def test_shipped_file_is_the_generators_output() -> None:
    generated = generate_probes(DEFAULT_SEED)
    shipped = load_probes()
    assert [p.to_json() for p in generated] == [p.to_json() for p in shipped]
    assert probe_set_hash(generated) == probe_set_hash(shipped)


def test_same_seed_same_probes_other_seed_other_probes() -> None:
    small = {"calibration": 6, "held_out": 3}
    a, b = generate_probes(7, small), generate_probes(7, small)
    assert a == b
    assert [p.prompt for p in generate_probes(8, small)] != [p.prompt for p in a]


def test_counts_and_ids() -> None:
    probes = load_probes()
    counts = Counter((p.split, p.family) for p in probes)
    for family in FAMILIES:
        for split, n in PER_FAMILY.items():
            assert counts[(split, family)] == n
    assert len({p.id for p in probes}) == len(probes)
    assert len({p.prompt for p in probes}) == len(probes)


def test_splits_share_no_item() -> None:
    cal = load_probes(split="calibration")
    held = load_probes(split="held_out")
    assert not {p.prompt for p in cal} & {p.prompt for p in held}
    # ARC questions: by their options
    assert not {p.choices for p in cal if p.family == "science_mc"} & {p.choices for p in held if p.family == "science_mc"}
    # facts: no held-out fact's subject is asked about in calibration (same task)
    from policies.edge_quality import facts

    tables = {"capital": facts.CAPITALS, "symbol": facts.SYMBOLS, "author": facts.AUTHORS, "currency": facts.CURRENCIES}
    for task, table in tables.items():
        held_subjects = {row[0] for row in table if any(f"{row[0]}?" in p.prompt or f"{row[0]}." in p.prompt
                                                        for p in held if p.task == task)}
        assert held_subjects
        for p in cal:
            if p.task == task:
                assert not any(p.prompt.endswith((f" {s}?", f" {s}.", f" {s}", f"{s}'s currency?")) for s in held_subjects), p.prompt


def test_arc_subset_is_train_only_and_shipped() -> None:
    rows = [json.loads(line) for line in (package_dir() / ARC_FILE).read_text(encoding="utf-8").splitlines() if line]
    assert len(rows) == 300
    assert {r["source"] for r in rows} == {"easy", "challenge"}
    assert all(r["answer"] in "ABCD" and len(r["choices"]) == 4 for r in rows)


def test_probe_json_round_trip() -> None:
    p = load_probes()[0]
    assert Probe.from_json(json.loads(json.dumps(p.to_json()))) == p
    assert p.messages == [{"role": "user", "content": p.prompt}]
    assert default_probes_path().is_file()


def test_every_probe_has_a_checker_and_difficulty_grows() -> None:
    from policies.edge_quality.checkers import CHECKERS

    probes = load_probes()
    assert {p.check for p in probes} <= set(CHECKERS)
    arithmetic = [p for p in probes if p.family == "arithmetic"]
    assert min(p.level for p in arithmetic) == 1 and max(p.level for p in arithmetic) >= 10
