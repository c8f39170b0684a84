"""Serving learned adapters: the gate that lets a template be answered locally only once its measured disagreement's
upper bound is under the policy's bound (and takes it back when it breaks), decoding constrained to a label set, the
adapters' worker order and memory bound, and new artifacts taken from disk without a restart."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_engine.adapters import AdapterLimits, AdapterRunner
from edge_engine.sampling import Priority
from policies.cache.error_bound import wilson_upper
from policies.learn.artifacts import ArtifactDirectory
from policies.learn.examples import Tokenizer
from policies.learn.gate import SERVING, SHADOW, SUSPENDED, Gate, GateParams
from policies.learn.serving import LearnedServing, agrees
from policies.policy import Policy
from policies.trim.tokenizer import bundled_edge_model

pytest.importorskip("gguf", reason="the learn extra writes adapters (make install installs it)")

from policies.learn.config import LearnPolicy
from tests.support.learned import write_learned

SENTIMENT = "Say whether the review is positive or negative."


def review(text: str) -> list[dict[str, object]]:
    return [{"role": "system", "content": SENTIMENT}, {"role": "user", "content": text}]


# The gate.


def test_a_template_serves_only_once_the_upper_bound_of_its_disagreement_is_under_the_bound() -> None:
    params = GateParams(max_disagreement=0.02, confidence=0.95, min_observations=50, window=500)
    needed = next(n for n in range(1, 1000) if n >= 50 and wilson_upper(0, n, 0.95) <= 0.02)
    gate = Gate(params)
    states = [gate.observe(wrong=False) for _ in range(needed + 5)]
    assert states[: needed - 1] == [SHADOW] * (needed - 1)  # never serving before the bound holds ...
    assert states[needed - 1 :] == [SERVING] * 6  # ... and serving from the observation after which it does
    assert 130 <= needed <= 140  # about 135 agreeing answers at 0.02 and 95 %

    wrong_early = Gate(params)
    wrong_early.observe(wrong=True)
    for _ in range(needed):
        wrong_early.observe(wrong=False)
    assert wrong_early.state == SHADOW  # one disagreement among them: more evidence is needed


def test_a_serving_template_is_suspended_within_a_few_disagreements_and_serves_again_only_once_the_bound_holds() -> None:
    gate = Gate(GateParams(max_disagreement=0.02, min_observations=50, window=500))
    for _ in range(200):
        gate.observe(wrong=False)
    assert gate.serves
    # the traffic changed: every judged answer now disagrees
    wrong = 0
    while gate.state == SERVING:
        gate.observe(wrong=True)
        wrong += 1
    assert gate.state == SUSPENDED and wrong <= 5
    figures = gate.figures()
    needed = next(n for n in range(50, 1000) if wilson_upper(0, n, 0.95) <= 0.02)
    assert figures["disagreement_upper"] > 0.02 and figures["transitions"] == [
        {"state": SERVING, "after_judged": needed}, {"state": SUSPENDED, "after_judged": 200 + wrong}]
    for _ in range(20):  # the new traffic goes on being answered wrongly while in shadow
        assert gate.observe(wrong=True) == SUSPENDED
    back = 0
    while gate.state != SERVING:
        gate.observe(wrong=False)
        back += 1
    assert back > 400  # the disagreements stay in the window (500): it takes new evidence, not time, to serve again


def test_answers_agree_when_equal_once_normalised() -> None:
    assert agrees("Positive.", " positive") and agrees("New  York", "new york")
    assert not agrees("positive", "negative") and not agrees("denver", "dallas")


# The adapters' runner (real llama.cpp, the bundled model).


@pytest.fixture(scope="module")
def runner() -> Iterator[AdapterRunner]:
    found = AdapterRunner(bundled_edge_model(), AdapterLimits(n_ctx=512, n_threads=1, max_resident=1))
    yield found
    found.close()


@pytest.mark.slow
def test_a_label_set_answer_is_always_one_of_its_labels_chosen_as_the_trainer_scored_it(runner: AdapterRunner,
                                                                                           tmp_path: Path) -> None:  # fmt: skip
    from policies.learn.evaluate import Scorer

    manifest = write_learned(tmp_path, tenant="t", app="a", template="sent", version="v", labels=["positive", "negative"],
                             scale=0.5, seed=3)  # fmt: skip
    adapter = manifest.with_suffix(".gguf")
    tokenizer = Tokenizer(model=runner.model)
    options = [tokenizer.answer("positive"), tokenizer.answer("negative")]
    scorer = Scorer(bundled_edge_model(), adapter, n_ctx=512, threads=1)
    try:
        for text in ("I loved it", "A waste of money, it broke in a day"):
            prompt = tokenizer.prompt(review(text))
            ours = runner.submit(Priority.INTERACTIVE, lambda p=prompt: runner.choose(adapter, p, options)).result()
            assert ours == pytest.approx(scorer.continuations(prompt, options), abs=1e-6)
    finally:
        scorer.close()


@pytest.mark.slow
def test_interactive_calls_run_before_batch_ones_and_a_full_queue_refuses(runner: AdapterRunner) -> None:
    release, order = threading.Event(), []
    first = runner.submit(Priority.BATCH, release.wait)
    queued = [runner.submit(Priority.BATCH, lambda: order.append("batch-1")),
              runner.submit(Priority.BATCH, lambda: order.append("batch-2")),
              runner.submit(Priority.INTERACTIVE, lambda: order.append("interactive"))]  # fmt: skip
    release.set()
    for future in [first, *queued]:
        future.result(timeout=60)
    assert order == ["interactive", "batch-1", "batch-2"]


@pytest.mark.slow
def test_adapters_beyond_the_resident_bound_are_freed_and_loaded_again_with_the_same_answers(
    runner: AdapterRunner, tmp_path: Path
) -> None:
    one = write_learned(tmp_path, tenant="t", app="a", template="one", version="v", scale=0.5, seed=1).with_suffix(".gguf")
    two = write_learned(tmp_path, tenant="t", app="a", template="two", version="v", scale=0.5, seed=2).with_suffix(".gguf")
    tokenizer = Tokenizer(model=runner.model)
    prompt, options = tokenizer.prompt(review("Great value")), [tokenizer.answer("yes"), tokenizer.answer("no")]

    def ask(adapter: Path) -> list[float]:
        return runner.submit(Priority.INTERACTIVE, lambda: runner.choose(adapter, prompt, options)).result()

    evictions = runner.evictions
    first, other, again = ask(one), ask(two), ask(one)
    assert runner.evictions - evictions >= 2 and len(runner.resident) == 1  # max_resident 1
    assert first == again and first != other  # the adapter, not the context it last ran in, decides


# Artifacts on disk.


def learn_policy(**section: object) -> LearnPolicy:
    return LearnPolicy(Policy.load(extra={"learn": {"templates": {"sent": {"prefix": SENTIMENT}}, **section}}))


@pytest.mark.slow
def test_a_new_artifact_is_taken_without_a_restart_and_starts_in_shadow(runner: AdapterRunner, tmp_path: Path) -> None:
    from policies.artifact_dir import sha256_file

    policy = learn_policy()
    version = policy.for_app("t", "a").templates.by_name["sent"].version
    base_sha = sha256_file(bundled_edge_model())

    async def scenario() -> None:
        serving = LearnedServing(policy, tmp_path, runner, base_sha)
        await serving.refresh()
        assert serving.choice("t", "a", "sent", version) is None
        write_learned(tmp_path, tenant="t", app="a", template="sent", version=version, labels=["positive", "negative"],
                      created_at="2026-01-01T00:00:00+00:00")  # fmt: skip
        write_learned(tmp_path, tenant="t", app="a", template="sent", version=version, base_sha256="0" * 64, seed=9,
                      created_at="2026-06-01T00:00:00+00:00")  # another base model: never taken  # fmt: skip
        await serving.refresh()
        choice = serving.choice("t", "a", "sent", version)
        assert choice is not None and choice.gate.state == SHADOW and choice.artifact.labels == ("positive", "negative")
        assert serving.choice("t", "a", "sent", "another-definition") is None
        for _ in range(200):
            choice.gate.observe(wrong=False)
        assert choice.gate.serves
        newer = write_learned(tmp_path, tenant="t", app="a", template="sent", version=version, seed=4, scale=0.1,
                              created_at="2026-02-01T00:00:00+00:00")  # fmt: skip
        await serving.refresh()
        taken = serving.choice("t", "a", "sent", version)
        assert taken is not None and taken.artifact.sha256 == json.loads(newer.read_text())["sha256"]
        assert taken.gate.state == SHADOW  # a new adapter proves itself anew
        await serving.drain()

    asyncio.run(scenario())
    assert ArtifactDirectory(tmp_path, base_sha).scan()  # the scan alone finds the same


@pytest.mark.slow
def test_a_shadow_answer_below_the_threshold_is_not_judged_and_one_above_it_is(runner: AdapterRunner, tmp_path: Path) -> None:
    from policies.artifact_dir import sha256_file

    policy = learn_policy()
    version = policy.for_app("t", "a").templates.by_name["sent"].version
    # held-out answers: above 0.99 all agreed, below it none did, so the threshold is the lowest confidence >= 0.99
    write_learned(tmp_path, tenant="t", app="a", template="sent", version=version, labels=["positive", "negative"],
                  confidences=[(0.999, True), (0.995, True), (0.6, False), (0.55, False)])  # fmt: skip

    async def scenario() -> tuple[int, int, int]:
        serving = LearnedServing(policy, tmp_path, runner, sha256_file(bundled_edge_model()), seed=0)
        await serving.refresh()
        choice = serving.choice("t", "a", "sent", version)
        assert choice is not None and choice.threshold == 0.995
        local = await serving.answer(choice, review("I loved it"), Priority.INTERACTIVE)
        assert local is not None and local.text in ("positive", "negative") and 0.5 <= local.confidence <= 1.0
        assert serving.shadow_soon(choice, review("I loved it"), "positive", "t", "a")
        await serving.drain()
        figures = choice.gate.figures()
        return int(figures["shadowed"]), int(figures["confident_in_shadow"]), int(figures["judged"])

    shadowed, confident, judged = asyncio.run(scenario())
    assert shadowed == 1 and confident == judged  # judged exactly when confident enough to have been served
