"""`tierlane edge learn` on the bundled edge model: a tiny LoRA run writes an adapter GGUF named by its sha256 with a
complete manifest, llama.cpp loads it over the base and generates, its layout matches the torch model's, and a
repeat with the same seed gives the same adapter and figures."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from policies.learn.config import LearnSection
from policies.learn.pairs import FILENAME, PairReader, PairRow, PairStore, held_out
from policies.trim.tokenizer import bundled_edge_model

pytest.importorskip("peft", reason="the learn extra (make install installs it)")
torch = pytest.importorskip("torch")

from policies.learn.job import Learner, Written, plan  # noqa: E402
from policies.learn.trainer import Hyper  # noqa: E402

SYSTEM = "Say whether the review is positive or negative."
REVIEWS = [("I loved it", "positive"), ("Awful, broke in a day", "negative"), ("Great value", "positive"),
           ("Would not buy again", "negative"), ("Works perfectly", "positive"), ("Terrible support", "negative"),
           ("Five stars", "positive"), ("A waste of money", "negative")]  # fmt: skip
HYPER = Hyper(rank=4, alpha=8, batch_size=4, max_steps=2, learning_rate=5e-3, seed=7)


def pair_ids(prefix: str, train: int, held: int) -> list[str]:
    """Ids whose fixed split gives `train` training and `held` held-out pairs."""
    chosen: list[str] = []
    counts = {True: 0, False: 0}
    wanted = {True: held, False: train}
    i = 0
    while counts[True] < held or counts[False] < train:
        pid = f"{prefix}-{i}"
        side = held_out(pid)
        if counts[side] < wanted[side]:
            chosen.append(pid)
            counts[side] += 1
        i += 1
    return chosen


def rows(template: str, answers: list[tuple[str, str]]) -> list[PairRow]:
    out = []
    for pid, (text, answer) in zip(pair_ids(template, len(answers) - 2, 2), answers):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
        out.append(PairRow(pair_id=pid, tenant="acme", app="shop", template=template, template_version="v1",
                           matched_by="prefix", ts=1.9e9, expires_at=2.0e9, model="gpt-x", messages=json.dumps(messages),
                           variable=text, answer=answer, params="{}", input_tokens=None, output_tokens=None, max_pairs=100,
                           tenant_quota_bytes=None))  # fmt: skip
    return out


async def fill(path: Path, batch: list[PairRow]) -> None:
    store = PairStore(path, wall=lambda: 1.9e9)
    await store.open()
    for row in batch:
        assert store.add(row)
    await store.close()


@pytest.fixture(scope="module")
def learner() -> Iterator[Learner]:
    found = Learner(bundled_edge_model(), progress=False, threads=1)  # the suite's two workers share two cores
    yield found
    found.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("learn") / FILENAME
    # the same reviews with their answers in free text: a template whose answers form no label set
    free = [(text, f"The review says it is {answer}, {i}.") for i, (text, answer) in enumerate(REVIEWS)]
    asyncio.run(fill(path, rows("sentiment", REVIEWS) + rows("explain", free)))
    return path


def learn(learner: Learner, store: Path, out: Path, template: str = "sentiment", hyper: Hyper = HYPER) -> Written:
    with PairReader(store, wall=lambda: 1.9e9) as reader:
        job = plan(reader, "acme", "shop", template, LearnSection(min_pairs=8, threshold_disagreement=0.5))
    return learner.learn(job, hyper, out)


@pytest.fixture(scope="module")
def first(store: Path, tmp_path_factory: pytest.TempPathFactory) -> Written:
    """The command's run, with min_pairs and threshold_disagreement from the policy in the settings file."""
    import yaml

    from gateway.cli import main

    config = tmp_path_factory.mktemp("config") / "tierlane.yaml"
    config.write_text(yaml.safe_dump({"state_dir": str(store.parent),
                                      "policy": {"learn": {"min_pairs": 8, "threshold_disagreement": 0.5}}}))  # fmt: skip
    out = tmp_path_factory.mktemp("out")
    args = ["edge", "learn", "--config", str(config), "--out", str(out), "--template", "sentiment", "--rank", "4",
            "--batch-size", "4", "--max-steps", "2", "--learning-rate", "5e-3", "--seed", "7", "--threads", "1", "--quiet"]  # fmt: skip
    assert main(args) == 0
    (manifest,) = out.glob("*/*/*/*.json")
    return Written(artifact=manifest.with_suffix(".gguf"), manifest=manifest, summary={})


def test_a_run_writes_an_adapter_named_by_its_sha256_and_a_complete_manifest(first: Written) -> None:
    import hashlib

    sha = hashlib.sha256(first.artifact.read_bytes()).hexdigest()
    assert first.artifact.name == f"{sha}.gguf" and first.manifest == first.artifact.with_suffix(".json")
    assert first.artifact.parent.parts[-3:] == ("acme", "shop", "sentiment")
    m = json.loads(first.manifest.read_text())
    assert (m["sha256"], m["template"], m["template_version"], m["tenant"], m["app"]) == (sha, "sentiment", "v1", "acme", "shop")
    assert m["base_model"]["path"] == str(bundled_edge_model()) and len(m["base_model"]["sha256"]) == 64
    assert m["pairs"] == {"train": 6, "held_out": 2, "held_out_evaluated": 2, "left_out_too_long": 0}
    t = m["training"]
    assert (t["method"], t["seed"], t["steps"], t["stopped_by"], t["hyper"]["rank"]) == ("lora", 7, 2, "steps", 4)
    assert t["seconds"] > 0 and t["tokens"] > 0 and len(t["losses"]) == 2
    c = m["confidence"]
    assert c["kind"] == "label_probability" and sorted(c["labels"]) == ["negative", "positive"]
    assert m["evaluation"]["kind"] == "labels" and 0.0 <= m["evaluation"]["agreement"] <= 1.0
    assert c["target_agreement"] == 0.5 and len(c["held_out"]) == 2
    for scored in c["held_out"]:
        assert scored["label"] in c["labels"] and 0.5 <= scored["confidence"] <= 1.0 and isinstance(scored["agrees"], bool)
    assert c["threshold"] is None or c["coverage"] > 0


def test_the_adapter_loads_into_llama_cpp_over_the_base_and_generates(first: Written) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(bundled_edge_model()), lora_path=str(first.artifact), n_ctx=256, n_threads=1,
                          n_threads_batch=1, verbose=False)  # fmt: skip
    try:
        out: Any = llm.create_chat_completion(
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Best purchase this year"}],
            max_tokens=4, temperature=0.0)  # fmt: skip
        assert out["usage"]["completion_tokens"] >= 1 and isinstance(out["choices"][0]["message"]["content"], str)
    finally:
        llm.close()


def test_a_repeat_with_the_same_seed_gives_the_same_adapter_and_figures(
    first: Written, learner: Learner, store: Path, tmp_path: Path
) -> None:
    again = learn(learner, store, tmp_path)
    a, b = json.loads(first.manifest.read_text()), json.loads(again.manifest.read_text())
    assert again.artifact.name == first.artifact.name  # byte for byte
    assert a["training"]["losses"] == b["training"]["losses"]
    assert a["evaluation"]["agreement"] == b["evaluation"]["agreement"]
    assert a["confidence"] == b["confidence"]


def test_a_free_text_template_is_scored_by_its_greedy_answer_and_mean_logprob(
    learner: Learner, store: Path, tmp_path: Path
) -> None:
    hyper = Hyper(rank=4, alpha=8, batch_size=6, max_steps=1, max_batch_tokens=64)  # the step in slices of 64 tokens
    m = json.loads(learn(learner, store, tmp_path, "explain", hyper).manifest.read_text())
    assert m["confidence"]["kind"] == "mean_token_logprob" and m["confidence"]["labels"] is None
    assert m["evaluation"]["kind"] == "exact_match"
    assert all(s["confidence"] <= 0.0 and "label" not in s for s in m["confidence"]["held_out"])


def test_llama_cpp_reads_the_adapter_as_torch_applies_it(learner: Learner, tmp_path: Path) -> None:
    """The layout check: q/k rows permuted, a [rank, in], b [out, rank]. With a large random adapter on every
    projection, llama.cpp's logits over the base and the file are as close to torch's (LoRA applied) as the two
    engines' base logits are to each other, and far from torch's base logits."""
    import llama_cpp
    from peft import LoraConfig, get_peft_model

    from policies.learn.adapter import write_adapter
    from policies.learn.trainer import TARGET_MODULES, lora_weights

    ids = [1, *range(400, 424)]
    model = learner.model
    with torch.no_grad():
        base = model(torch.tensor([ids])).logits[0].numpy()
    torch.manual_seed(0)
    wrapped = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGET_MODULES)))
    try:
        with torch.no_grad():
            for name, param in wrapped.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.05)
            adapted = wrapped(input_ids=torch.tensor([ids])).logits[0].numpy()
        path, _ = write_adapter(lora_weights(wrapped), learner.shape, 8.0, tmp_path, name="random")
    finally:
        wrapped.unload()

    def cpp(lora: Path | None) -> np.ndarray:
        llm = llama_cpp.Llama(model_path=str(bundled_edge_model()), lora_path=str(lora) if lora else None, n_ctx=64,
                              logits_all=True, n_threads=1, n_threads_batch=1, verbose=False)  # fmt: skip
        try:
            llm.eval(ids)
            return np.array(llm.scores[: len(ids)])
        finally:
            llm.close()

    engines_apart = float(np.abs(cpp(None) - base).mean())
    with_file = float(np.abs(cpp(path) - adapted).mean())
    assert float(np.abs(adapted - base).mean()) > 2 * engines_apart  # the adapter changes the logits
    assert with_file < 1.3 * engines_apart
