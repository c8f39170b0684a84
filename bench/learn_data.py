"""Labelled workloads for the learn benchmark: public datasets turned into one JSONL per task.

Three workloads, each a repeated task an app sends an upstream model, with a known right answer:

* ``sentiment.jsonl``: GLUE SST-2 sentences, label ``positive`` or ``negative``.
  Source: github.com/eyalbd2/Reproducing-AutoPrompt at 6288fb5bec9c572f2492875ae0111df5b6daed11,
  ``glue_data/SST-2/train_full.tsv`` (the full GLUE train, 67,349 rows) and ``glue_data/SST-2/dev.tsv``
  (the GLUE dev, 872 rows, used as the test split). Licence file beside it: the repository's Apache-2.0
  (the SST corpus itself states no licence).
* ``intent.jsonl``: Banking77 queries, label the intent name (77 of them, e.g. ``card_arrival``).
  Source: github.com/PolyAI-LDN/task-specific-datasets at 57ec275d8078af65b7731c2a98be812d844a6d6b,
  ``banking_data/train.csv`` and ``banking_data/test.csv``; CC BY 4.0.
* ``extraction.jsonl``: ATIS flight requests with exactly one ``toloc.city_name`` slot, label that span
  as written in the input (the destination city). Source: github.com/MiuLab/SlotGated-SLU at
  61f0307c729b1fad479ef1de94aa5ac5dee601b0, ``data/atis/{train,valid,test}/seq.in`` and ``seq.out``
  (train and valid make the train split). The repository has no licence file; ATIS comes from the LDC.

Each line is ``{"id": str, "input": str, "label": str, "split": "train" | "test"}``. Within a split an input
appears once (first occurrence kept), a train input never equals a test input, and at most ``--max-train``
train and ``--max-test`` test lines are kept per workload, drawn with ``--seed`` (the kept lines are in
source order). Each workload's licence text is copied beside it (``<workload>_LICENSE.txt``) and a
``README.md`` names the sources, commits, paths, licences and counts.

Run (each source is a git directory, e.g. a bare mirror, read at ``--rev``; or a folder holding the same
paths as plain files)::

    .venv/bin/python bench/learn_data.py \\
        --sst2 /work/.mirror/eyalbd2+Reproducing-AutoPrompt/repo \\
        --banking77 /work/.mirror/PolyAI-LDN+task-specific-datasets/repo \\
        --atis /work/.mirror/MiuLab+SlotGated-SLU/repo \\
        --out /work/shared/data/learn

Standard library only; reads and writes nothing but the sources and ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import random
import subprocess
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Split = Literal["train", "test"]

DEFAULT_OUT = Path("/work/shared/data/learn")
SST2_TRAIN = "glue_data/SST-2/train_full.tsv"
SST2_TEST = "glue_data/SST-2/dev.tsv"
BANKING_TRAIN = "banking_data/train.csv"
BANKING_TEST = "banking_data/test.csv"
ATIS_TRAIN = ("data/atis/train", "data/atis/valid")
ATIS_TEST = ("data/atis/test",)
ATIS_SLOT = "toloc.city_name"

NO_LICENCE_ATIS = """\
No licence file is present in github.com/MiuLab/SlotGated-SLU (commit {commit}).

The ATIS utterances and slot annotations there are the widely redistributed ATIS split
(4,478 train / 500 valid / 893 test) derived from the ATIS-2 (LDC93S5) and ATIS-3 (LDC94S19, LDC95S26) corpora, which the
Linguistic Data Consortium distributes under its user agreement.
Use this workload for research benchmarking only.
"""

SST2_NOTE = """\
The Stanford Sentiment Treebank (Socher et al., 2013), as packaged for GLUE SST-2, states no licence
of its own. The text below is the licence of the repository the files were taken from,
github.com/eyalbd2/Reproducing-AutoPrompt (commit {commit}).

"""


@dataclass(frozen=True)
class Row:
    id: str
    input: str
    label: str
    split: Split


@dataclass(frozen=True)
class Source:
    """A git directory (read at ``rev``) or a plain folder."""

    root: Path
    rev: str

    def is_git(self) -> bool:
        return (self.root / "HEAD").is_file() and (self.root / "objects").is_dir()

    def read(self, path: str) -> str:
        if self.is_git():
            out = subprocess.run(
                ["git", "--git-dir", str(self.root), "show", f"{self.rev}:{path}"],
                check=True,
                capture_output=True,
            ).stdout
            return out.decode("utf-8")
        return (self.root / path).read_text(encoding="utf-8")

    def commit(self) -> str:
        if not self.is_git():
            return "unknown (plain folder)"
        return subprocess.run(
            ["git", "--git-dir", str(self.root), "rev-parse", f"{self.rev}^{{commit}}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()


@dataclass(frozen=True)
class Workload:
    name: str
    rows: list[Row]
    repo: str
    commit: str
    paths: list[str]
    licence_name: str
    licence_text: str
    notes: str


def clean(text: str) -> str:
    return " ".join(text.split())


def sst2_rows(src: Source) -> list[Row]:
    names = {"0": "negative", "1": "positive"}
    rows: list[Row] = []
    parts: tuple[tuple[Split, str], ...] = (("train", SST2_TRAIN), ("test", SST2_TEST))
    for split, path in parts:
        lines = src.read(path).splitlines()
        header = lines[0].split("\t")
        if header[:2] != ["sentence", "label"]:
            raise ValueError(f"{path}: unexpected header {header}")
        for n, line in enumerate(lines[1:], start=1):
            sentence, label = line.rsplit("\t", 1)
            rows.append(Row(f"sst2-{split}-{n}", clean(sentence), names[label.strip()], split))
    return rows


def banking_rows(src: Source) -> list[Row]:
    rows: list[Row] = []
    parts: tuple[tuple[Split, str], ...] = (("train", BANKING_TRAIN), ("test", BANKING_TEST))
    for split, path in parts:
        reader = csv.DictReader(io.StringIO(src.read(path)))
        for n, rec in enumerate(reader, start=1):
            rows.append(Row(f"banking77-{split}-{n}", clean(rec["text"]), rec["category"].strip(), split))
    return rows


def single_span(tokens: list[str], tags: list[str], slot: str) -> str | None:
    """The one ``slot`` span's words, or None when the tags hold none or several."""
    starts = [i for i, tag in enumerate(tags) if tag == f"B-{slot}"]
    if len(starts) != 1 or any(tag == f"I-{slot}" and (i == 0 or tags[i - 1][2:] != slot) for i, tag in enumerate(tags)):
        return None
    end = starts[0] + 1
    while end < len(tags) and tags[end] == f"I-{slot}":
        end += 1
    return " ".join(tokens[starts[0] : end])


def atis_rows(src: Source) -> list[Row]:
    rows: list[Row] = []
    parts: tuple[tuple[Split, tuple[str, ...]], ...] = (("train", ATIS_TRAIN), ("test", ATIS_TEST))
    for split, folders in parts:
        for folder in folders:
            part = folder.rsplit("/", 1)[1]
            words = src.read(f"{folder}/seq.in").splitlines()
            tags = src.read(f"{folder}/seq.out").splitlines()
            if len(words) != len(tags):
                raise ValueError(f"{folder}: {len(words)} inputs, {len(tags)} tag lines")
            for n, (w, t) in enumerate(zip(words, tags), start=1):
                tokens, labels = w.split(), t.split()
                if len(tokens) != len(labels):
                    raise ValueError(f"{folder} line {n}: {len(tokens)} words, {len(labels)} tags")
                span = single_span(tokens, labels, ATIS_SLOT)
                if span is None:
                    continue
                text = " ".join(tokens)
                if span not in text:
                    raise ValueError(f"{folder} line {n}: span {span!r} not in input")
                rows.append(Row(f"atis-{part}-{n}", text, span, split))
    return rows


def select(rows: Iterable[Row], max_train: int, max_test: int, seed: int) -> list[Row]:
    """Dedupe within each split, drop train inputs seen in test, then a seeded sample kept in source order."""
    by_split: dict[Split, list[Row]] = {"train": [], "test": []}
    seen: dict[Split, set[str]] = {"train": set(), "test": set()}
    for row in rows:
        if row.input and row.input not in seen[row.split]:
            seen[row.split].add(row.input)
            by_split[row.split].append(row)
    train = [r for r in by_split["train"] if r.input not in seen["test"]]
    out: list[Row] = []
    for part, cap in ((train, max_train), (by_split["test"], max_test)):
        if len(part) > cap:
            keep = set(random.Random(seed).sample(range(len(part)), cap))
            part = [r for i, r in enumerate(part) if i in keep]
        out.extend(part)
    return out


@dataclass(frozen=True)
class Stats:
    train: int
    test: int
    labels: int
    train_labels: int
    test_labels: int
    top: list[tuple[str, int]]


def write(out: Path, work: Workload) -> Stats:
    with (out / f"{work.name}.jsonl").open("w", encoding="utf-8") as f:
        for row in work.rows:
            f.write(json.dumps({"id": row.id, "input": row.input, "label": row.label, "split": row.split}, ensure_ascii=False))
            f.write("\n")
    (out / f"{work.name}_LICENSE.txt").write_text(work.licence_text, encoding="utf-8")
    counts = Counter(r.split for r in work.rows)
    labels = {split: Counter(r.label for r in work.rows if r.split == split) for split in ("train", "test")}
    return Stats(
        train=counts["train"],
        test=counts["test"],
        labels=len({r.label for r in work.rows}),
        train_labels=len(labels["train"]),
        test_labels=len(labels["test"]),
        top=Counter(r.label for r in work.rows).most_common(3),
    )


def readme(works: list[Workload], stats: dict[str, Stats], args: argparse.Namespace) -> str:
    lines = [
        "# Learn benchmark data",
        "",
        "Written by `bench/learn_data.py` (in the tierlane repository); not committed anywhere. Each line of a",
        '`<workload>.jsonl` is `{"id", "input", "label", "split"}` with split `train` or `test`. Within a split an',
        "input appears once, no train input equals a test input, and at most",
        f"{args.max_train} train + {args.max_test} test lines are kept, a sample drawn with seed {args.seed}",
        "(kept in source order).",
        "",
        "| file | source repository | commit | paths | licence | train | test | labels |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w in works:
        s = stats[w.name]
        lines.append(
            f"| `{w.name}.jsonl` | {w.repo} | `{w.commit}` | {', '.join(f'`{p}`' for p in w.paths)} "
            f"| {w.licence_name} (`{w.name}_LICENSE.txt`) | {s.train} | {s.test} | {s.labels} |"
        )
    lines.append("")
    for w in works:
        s = stats[w.name]
        lines += [
            f"## {w.name}",
            "",
            w.notes,
            "",
            f"Labels: {s.labels} in all, {s.train_labels} in train, {s.test_labels} in test; most frequent: "
            + ", ".join(f"`{label}` ({n})" for label, n in s.top)
            + ".",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    p.add_argument("--sst2", type=Path, required=True, help="eyalbd2/Reproducing-AutoPrompt git dir or folder")
    p.add_argument("--banking77", type=Path, required=True, help="PolyAI-LDN/task-specific-datasets git dir or folder")
    p.add_argument("--atis", type=Path, required=True, help="MiuLab/SlotGated-SLU git dir or folder")
    p.add_argument("--rev", default="HEAD", help="revision read in each git dir (default HEAD)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--max-train", type=int, default=6000)
    p.add_argument("--max-test", type=int, default=1500)
    p.add_argument("--seed", type=int, default=20240601)
    args = p.parse_args()

    sst2, banking, atis = Source(args.sst2, args.rev), Source(args.banking77, args.rev), Source(args.atis, args.rev)
    sst2_commit, banking_commit, atis_commit = sst2.commit(), banking.commit(), atis.commit()

    def pick(rows: list[Row]) -> list[Row]:
        return select(rows, args.max_train, args.max_test, args.seed)

    works = [
        Workload(
            "sentiment",
            pick(sst2_rows(sst2)),
            "[eyalbd2/Reproducing-AutoPrompt](https://github.com/eyalbd2/Reproducing-AutoPrompt)",
            sst2_commit,
            [SST2_TRAIN, SST2_TEST],
            "SST: none stated; repository: Apache-2.0",
            SST2_NOTE.format(commit=sst2_commit) + sst2.read("LICENSE"),
            "GLUE SST-2 (Stanford Sentiment Treebank phrases and sentences from movie reviews). Train: the full GLUE "
            "train (`train_full.tsv`, 67,349 rows; the repository's `train.tsv` is a 1,000-row subset). Test: the "
            "GLUE dev set (872 rows; the GLUE test labels are hidden). Label `0` -> `negative`, `1` -> `positive`; "
            "inputs have whitespace collapsed (tokenised, lower-cased text as GLUE ships it). Ids: "
            "`sst2-<split>-<data row number>`.",
        ),
        Workload(
            "intent",
            pick(banking_rows(banking)),
            "[PolyAI-LDN/task-specific-datasets](https://github.com/PolyAI-LDN/task-specific-datasets)",
            banking_commit,
            [BANKING_TRAIN, BANKING_TEST],
            "CC BY 4.0",
            banking.read("LICENSE"),
            "Banking77 (Casanueva et al., 2020): online-banking customer queries, label the intent category name "
            "as the dataset spells it (e.g. `card_arrival`). Ids: `banking77-<split>-<csv record number>`.",
        ),
        Workload(
            "extraction",
            pick(atis_rows(atis)),
            "[MiuLab/SlotGated-SLU](https://github.com/MiuLab/SlotGated-SLU)",
            atis_commit,
            [f"{d}/seq.in" for d in ATIS_TRAIN + ATIS_TEST] + [f"{d}/seq.out" for d in ATIS_TRAIN + ATIS_TEST],
            "none in repository; ATIS is LDC material (see file)",
            NO_LICENCE_ATIS.format(commit=atis_commit),
            "ATIS flight requests (tokenised, lower-cased) whose BIO slot tags hold exactly one "
            f"`{ATIS_SLOT}` span; the task is to name the destination city, and the label is that span's words "
            "exactly as they appear in the input (e.g. `dallas`, `new york`). Requests with no or several "
            "destination-city spans are skipped. Train: ATIS train + valid; test: ATIS test. Ids: "
            "`atis-<train|valid|test>-<line number>`.",
        ),
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    stats = {w.name: write(args.out, w) for w in works}
    (args.out / "README.md").write_text(readme(works, stats, args), encoding="utf-8")
    for name, s in stats.items():
        print(f"{name}: train {s.train}, test {s.test}, labels {s.labels} (train {s.train_labels}, test {s.test_labels})")


if __name__ == "__main__":
    main()
