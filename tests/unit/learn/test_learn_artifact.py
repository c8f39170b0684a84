"""What `tierlane edge learn` decides without a model: the refusal below min_pairs, the label set, the confidence
threshold, and the adapter file's layout (llama.cpp's names, shapes and keys)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from gateway.cli import main
from policies.learn.base_model import BaseShape, permute, unpermute
from policies.learn.calibration import Scored, label_probabilities, threshold
from policies.learn.config import LearnPolicy, LearnSection
from policies.learn.examples import label_set, normalise
from policies.learn.job import NotEnoughPairs, plan
from policies.learn.pairs import FILENAME, PairReader, PairRow, PairStore
from policies.policy import Policy

gguf = pytest.importorskip("gguf", reason="the learn extra (make install installs it)")


def row(i: int, template: str = "sentiment", version: str = "v2") -> PairRow:
    return PairRow(pair_id=f"p{i}", tenant="acme", app="shop", template=template, template_version=version,
                   matched_by="header", ts=1.9e9, expires_at=2.0e9, model="gpt-x", messages='[{"role": "user", "content": "x"}]',
                   variable="x", answer="positive", params="{}", input_tokens=None, output_tokens=None, max_pairs=100,
                   tenant_quota_bytes=None)  # fmt: skip


def store(tmp_path: Path, rows: list[PairRow]) -> Path:
    async def go() -> None:
        s = PairStore(tmp_path / FILENAME, wall=lambda: 1.9e9)
        await s.open()
        for r in rows:
            s.add(r)
        await s.close()

    asyncio.run(go())
    return tmp_path / FILENAME


def test_fewer_pairs_than_min_pairs_are_refused_naming_the_template_and_the_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = store(tmp_path, [row(i) for i in range(12)])
    assert main(["edge", "learn", "--state-dir", str(tmp_path), "--template", "sentiment", "--quiet"]) == 1
    captured = capsys.readouterr()
    assert "'sentiment' of acme/shop: 12 pairs" in captured.err and "min_pairs 200" in captured.err
    assert json.loads(captured.out)["written"] == [] and not (tmp_path / "learn").exists()
    # only the newest definition's pairs count: 3 of version v3 are too few even for min_pairs 10
    path = store(tmp_path, [row(100 + i, version="v3") for i in range(3)])
    with PairReader(path, wall=lambda: 1.9e9) as reader, pytest.raises(NotEnoughPairs, match=r"3 pairs .*version v3"):
        plan(reader, "acme", "shop", "sentiment", LearnSection(min_pairs=10))


def test_min_pairs_is_a_learn_policy_setting_per_tenant_app() -> None:
    policy = LearnPolicy(Policy.load(extra={"learn": {"overrides": [{"match": {"tenant": "acme"}, "set": {"min_pairs": 50}}]}}))
    assert policy.section_for("acme", "shop").min_pairs == 50
    assert policy.section_for("other", "shop").min_pairs == 200 and policy.section_for("other", "x").max_disagreement == 0.02


def test_the_cli_refuses_bad_arguments_before_reading_anything(tmp_path: Path) -> None:
    assert main(["edge", "learn", "--state-dir", str(tmp_path), "--template", "no/such"]) == 2
    assert main(["edge", "learn", "--state-dir", str(tmp_path), "--app", "shop"]) == 2
    assert main(["edge", "learn", "--state-dir", str(tmp_path), "--batch-size", "0"]) == 2
    assert main(["edge", "learn", "--state-dir", str(tmp_path)]) == 2  # no pair file there


def test_answers_form_a_label_set_when_few_labels_cover_nearly_all() -> None:
    assert normalise("  Yes.\n") == normalise("yes") == "yes" and normalise("Ｙｅｓ") == "yes"
    answers = ["Yes"] * 30 + ["yes."] * 5 + ["No"] * 20 + ["maybe, it depends"]
    assert label_set(answers) == ["Yes", "No"]  # 55 of 56 covered; the upstream's spelling of each
    assert label_set([f"answer {i}" for i in range(40)]) is None  # free text
    assert label_set(["a", "b", "c"]) is None  # each once: no label repeats
    assert label_set(["Yes"] * 10 + [f"x{i}" for i in range(2)]) is None  # 10 of 12 is under 95 %
    assert label_set([f"l{i % 25}" for i in range(100)]) is None  # 25 labels: more than 20


def test_the_threshold_is_the_lowest_confidence_whose_answers_agree_often_enough() -> None:
    def s(conf: float, ok: bool) -> Scored:
        return Scored(pair_id=str(conf), answer="", confidence=conf, agrees=ok)

    scored = [s(0.99, True), s(0.95, True), s(0.9, True), s(0.8, False), s(0.7, True), s(0.6, False), s(0.55, False)]
    bound = threshold(scored, max_disagreement=0.2)  # 0.7 keeps 5, 4 agree: 0.8 >= 0.8
    assert (bound.threshold, bound.coverage, bound.agreement) == (0.7, 5 / 7, 0.8)
    assert threshold(scored, max_disagreement=0.01).threshold == 0.9
    assert threshold([s(0.9, False)], max_disagreement=0.1).threshold is None
    tie = threshold([s(0.9, True), s(0.9, False), s(0.5, True)], max_disagreement=0.3)
    assert tie.threshold is None  # 0.9 keeps both 0.9s (one in two agree), 0.5 all three (two in three)
    probs = label_probabilities([-1.0, -2.0, -30.0])
    assert abs(sum(probs) - 1) < 1e-12 and probs[0] > probs[1] > probs[2]


def test_q_and_k_rows_go_back_and_forth_between_hugging_face_and_llama_cpp_order() -> None:
    rows = np.arange(12 * 3, dtype=np.float32).reshape(12, 3)
    assert np.array_equal(unpermute(permute(rows, 3), 3), rows)
    # llama.cpp interleaves each head's two rotary halves: rows 0, 2, 1, 3 of a 4-row head
    assert permute(np.arange(4.0)[:, None], 1)[:, 0].tolist() == [0.0, 2.0, 1.0, 3.0]


def test_the_adapter_file_is_named_by_its_sha256_and_laid_out_as_llama_cpp_reads_lora(tmp_path: Path) -> None:
    from policies.learn.adapter import write_adapter

    rank, d, kv, ff = 2, 8, 4, 12
    rng = np.random.default_rng(0)
    shapes = {"self_attn.q_proj": (d, d), "self_attn.k_proj": (kv, d), "mlp.down_proj": (d, ff)}
    weights = {f"model.layers.{i}.{m}": (rng.normal(size=(rank, n_in)).astype(np.float32),
                                         rng.normal(size=(n_out, rank)).astype(np.float32))
               for i in range(2) for m, (n_out, n_in) in shapes.items()}  # fmt: skip
    shape = BaseShape(architecture="llama", n_layers=2, n_head=2, n_head_kv=1)
    path, sha = write_adapter(weights, shape, 4.0, tmp_path, name="t")
    assert path.name == f"{sha}.gguf" and hashlib.sha256(path.read_bytes()).hexdigest() == sha
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no part file left
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.type"].contents() == "adapter"
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["adapter.type"].contents() == "lora"
    assert reader.fields["adapter.lora.alpha"].contents() == 4.0
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 12
    a, b = tensors["blk.1.ffn_down.weight.lora_a"], tensors["blk.1.ffn_down.weight.lora_b"]
    assert [int(n) for n in a.shape] == [ff, rank] and [int(n) for n in b.shape] == [rank, d]  # ggml ne: a [in, r], b [r, out]
    assert np.array_equal(np.asarray(a.data).reshape(rank, ff), weights["model.layers.1.mlp.down_proj"][0])
    q_b = np.asarray(tensors["blk.0.attn_q.weight.lora_b"].data).reshape(d, rank)
    assert np.array_equal(q_b, permute(weights["model.layers.0.self_attn.q_proj"][1], 2))
    k_b = np.asarray(tensors["blk.0.attn_k.weight.lora_b"].data).reshape(kv, rank)
    assert np.array_equal(k_b, permute(weights["model.layers.0.self_attn.k_proj"][1], 1))
    again, same = write_adapter(weights, shape, 4.0, tmp_path, name="t")
    assert (again, same) == (path, sha)


def test_a_step_goes_through_in_slices_within_the_padded_token_bound() -> None:
    from policies.learn.examples import Example
    from policies.learn.trainer import _slices

    def ex(n: int) -> Example:
        return Example(pair_id=str(n), prompt=(1,) * (n - 1), answer=(2,), text="")

    batch = [ex(10), ex(30), ex(20), ex(50), ex(5)]
    assert [[e.tokens for e in part] for part in _slices(batch, 64)] == [[10, 30], [20], [50], [5]]
    assert [len(part) for part in _slices(batch, 1000)] == [5]
    assert [len(part) for part in _slices([ex(80)], 64)] == [1]  # one example longer than the bound still trains
