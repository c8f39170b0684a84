"""Serving learned templates: the adapters found on disk, answered by the edge only once their gate allows it.

The running gateway rescans the adapters' directory every `rescan_s` (policies/learn/artifacts.py)
and takes a new artifact without a restart; a new artifact starts in `shadow` with a gate of its
own (policies/learn/gate.py), whatever the one it replaces had proven. An artifact serves a
template only while the template's current definition is the one it was trained on (its version).

An answer is the adapter's, in the edge engine's tokens (policies/learn/examples.Tokenizer, the
prompt rendered with the GGUF's chat template as in training): on a label set, the label chosen
among the labels only (constrained decoding), its probability among them the confidence; in free
text, the greedy answer, its mean token log-probability the confidence, and an answer cut by the
token bound is never confident. The threshold is the artifact's held-out answers' (its manifest)
at the template's `threshold_disagreement`.

Shadow answers are batch priority on the adapters' worker and best effort: sampled at
`shadow_rate`, dropped (counted) when the worker's queue is full.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_engine.adapters import AdapterRunner
from edge_engine.errors import EngineBusy
from edge_engine.sampling import Priority
from policies.learn.artifacts import Artifact, ArtifactDirectory, Key
from policies.learn.calibration import label_probabilities
from policies.learn.config import LearnPolicy, LearnSection
from policies.learn.examples import Tokenizer, normalise
from policies.learn.gate import Gate, GateParams

log = logging.getLogger(__name__)

_MAX_SECTIONS = 10_000


@dataclass(frozen=True, slots=True)
class Local:
    """The adapter's answer to one request."""

    text: str
    confidence: float
    confident: bool  # at or above the artifact's threshold
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class Choice:
    """What to do with one request of a learned template."""

    artifact: Artifact
    gate: Gate
    threshold: float | None


def agrees(ours: str, theirs: str) -> bool:
    """The judge of a learned template: the answers equal once normalised (case, width, spacing, a closing period)."""
    return normalise(ours) == normalise(theirs)


class LearnedServing:
    """The artifacts of every learned template, their gates, and the adapter runner that answers them."""

    def __init__(self, policy: LearnPolicy, directory: Path, runner: AdapterRunner, base_sha256: str, *,
                 rescan_s: float = 5.0, seed: int | None = None) -> None:  # fmt: skip
        self.policy = policy
        self.directory = directory
        self.runner = runner
        self.tokenizer = Tokenizer(model=runner.model)
        self.rescan_s = rescan_s
        self._found = ArtifactDirectory(directory, base_sha256)
        self._artifacts: dict[Key, Artifact] = {}
        self._gates: dict[tuple[Key, str], Gate] = {}
        self._thresholds: dict[tuple[str, float], float | None] = {}  # (sha256, threshold_disagreement) -> threshold
        self._sections: dict[tuple[str, str], LearnSection] = {}
        self._rng = random.Random(seed)
        self._tasks: set[asyncio.Task[None]] = set()
        self._rescan: asyncio.Task[None] | None = None
        self.dropped = 0  # shadow answers not made: the worker's queue was full
        self.failed = 0

    # Artifacts.

    async def start(self) -> None:
        await self.refresh()
        self._rescan = asyncio.get_running_loop().create_task(self._rescan_loop())

    async def refresh(self) -> None:
        """Read the directory again; new artifacts are taken now."""
        found = await asyncio.to_thread(self._found.scan)
        for key, artifact in found.items():
            if key not in self._artifacts or self._artifacts[key].sha256 != artifact.sha256:
                log.info("learned template %s: adapter %s (held-out agreement %.3f, %d pairs); shadow until its bound holds",
                         "/".join(key), artifact.name, artifact.agreement, artifact.pairs_train)  # fmt: skip
        self._artifacts = found
        # gates and thresholds of adapters no longer on disk (replaced or deleted) go with them
        current = {(a.key, a.sha256) for a in found.values()}
        self._gates = {k: g for k, g in self._gates.items() if k in current}
        shas = {a.sha256 for a in found.values()}
        self._thresholds = {k: t for k, t in self._thresholds.items() if k[0] in shas}

    async def _rescan_loop(self) -> None:
        while True:
            await asyncio.sleep(self.rescan_s)
            try:
                await self.refresh()
            except Exception:  # a failed scan keeps the artifacts it had
                log.exception("learned adapters: scanning %s failed", self.directory)

    def section(self, tenant: str, app: str) -> LearnSection:
        found = self._sections.get((tenant, app))
        if found is None:
            found = self.policy.section_for(tenant, app)
            if len(self._sections) < _MAX_SECTIONS:
                self._sections[(tenant, app)] = found
        return found

    def choice(self, tenant: str, app: str, template: str, version: str) -> Choice | None:
        """The artifact of a template and its gate; None without one for the template's current definition."""
        artifact = self._artifacts.get((tenant, app, template))
        if artifact is None or artifact.template_version != version:
            return None
        section = self.section(tenant, app)
        gate = self._gates.get((artifact.key, artifact.sha256))
        if gate is None:
            params = GateParams(max_disagreement=section.max_disagreement, confidence=section.confidence,
                                min_observations=section.min_observations, window=section.window)  # fmt: skip
            gate = self._gates[(artifact.key, artifact.sha256)] = Gate(params)
        key = (artifact.sha256, section.threshold_disagreement)
        if key not in self._thresholds:  # computed once per adapter and policy value, not per request
            self._thresholds[key] = artifact.threshold(section.threshold_disagreement).threshold
        return Choice(artifact, gate, self._thresholds[key])

    # Answers.

    async def answer(self, choice: Choice, messages: Sequence[Mapping[str, Any]], priority: Priority) -> Local | None:
        """The adapter's answer (None: the prompt does not fit the adapter's context); EngineBusy when full."""
        future = self.runner.submit(priority, lambda: self._answer(choice, messages))
        return await asyncio.wrap_future(future)

    def _answer(self, choice: Choice, messages: Sequence[Mapping[str, Any]]) -> Local | None:
        artifact, tokenizer = choice.artifact, self.tokenizer
        prompt = tokenizer.prompt([dict(m) for m in messages])
        if not self.runner.fits(len(prompt), artifact.answer_tokens_max):
            return None
        if artifact.labels is not None:
            options = [tokenizer.answer(label) for label in artifact.labels]
            probs = label_probabilities(self.runner.choose(artifact.path, prompt, options))
            best = max(range(len(probs)), key=probs.__getitem__)
            text, confidence, completion = artifact.labels[best], probs[best], len(options[best])
        else:
            stop = frozenset(tokenizer.end_of_turn)
            answer = self.runner.greedy(artifact.path, prompt, artifact.answer_tokens_max + 8, stop)
            text = b"".join(tokenizer.model.piece(t) for t in answer.tokens).decode("utf-8", errors="replace").strip()
            confidence = answer.mean_logprob if answer.ended and text else float("-inf")
            completion = len(answer.tokens) + 1
        confident = choice.threshold is not None and confidence >= choice.threshold
        return Local(text=text, confidence=confidence, confident=confident, prompt_tokens=len(prompt),
                     completion_tokens=completion)  # fmt: skip

    # Judging.

    def shadow_soon(self, choice: Choice, messages: Sequence[Mapping[str, Any]], upstream_text: str, tenant: str,
                    app: str) -> bool:  # fmt: skip
        """Sample an upstream answer of a template not serving: the adapter answers too, off the path, and is judged."""
        if choice.gate.serves or not upstream_text:
            return False
        if self._rng.random() >= self.section(tenant, app).shadow_rate:
            return False
        task = asyncio.get_running_loop().create_task(self._shadow(choice, list(messages), upstream_text))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _shadow(self, choice: Choice, messages: list[Mapping[str, Any]], upstream_text: str) -> None:
        try:
            local = await self.answer(choice, messages, Priority.BATCH)
        except EngineBusy:
            self.dropped += 1
            return
        except Exception as exc:  # noqa: BLE001 - a shadow answer never surfaces to anyone
            self.failed += 1
            log.warning("learned template %s: shadow answer failed: %s", "/".join(choice.artifact.key), exc)
            return
        if local is None:
            return
        choice.gate.count("shadowed")
        if local.confident:
            choice.gate.count("confident")
            self._observe(choice, local.text, upstream_text)

    def wants_recheck(self, tenant: str, app: str) -> bool:
        return self._rng.random() < self.section(tenant, app).recheck_rate

    def recheck(self, choice: Choice, served: str, upstream_text: str) -> None:
        """A served answer re-asked upstream: judged."""
        choice.gate.count("rechecked")
        self._observe(choice, served, upstream_text)

    def _observe(self, choice: Choice, ours: str, theirs: str) -> None:
        before = choice.gate.state
        after = choice.gate.observe(wrong=not agrees(ours, theirs))
        if after != before:
            figures = choice.gate.figures()
            log.info("learned template %s, adapter %s: %s -> %s (disagreement %s of %d judged, upper bound %.4f, bound %s)",
                     "/".join(choice.artifact.key), choice.artifact.name, before, after, figures["disagreed_total"],
                     figures["judged"], figures["disagreement_upper"], figures["max_disagreement"])  # fmt: skip

    # Figures.

    def figures(self, key: Key) -> dict[str, Any] | None:
        """What GET /v1/edge/templates shows of a template's artifact (None without one)."""
        artifact = self._artifacts.get(key)
        if artifact is None:
            return None
        gate = self._gates.get((key, artifact.sha256))
        threshold = artifact.threshold(self.section(key[0], key[1]).threshold_disagreement)
        out: dict[str, Any] = {
            "artifact": artifact.path.name, "sha256": artifact.sha256, "created_at": artifact.created_at,
            "template_version": artifact.template_version, "labels": list(artifact.labels) if artifact.labels else None,
            "held_out_agreement": artifact.agreement, "pairs_trained": artifact.pairs_train,
            "train_seconds": artifact.train_seconds, "threshold": threshold.threshold,
            "held_out_coverage": threshold.coverage,
        }  # fmt: skip
        figures = gate.figures() if gate is not None else {"state": "shadow", "judged": 0}
        return out | figures

    @property
    def keys(self) -> list[Key]:
        return list(self._artifacts)

    def states(self) -> dict[Key, str]:
        """The state of each template's current artifact."""
        out: dict[Key, str] = {}
        for key, artifact in self._artifacts.items():
            gate = self._gates.get((key, artifact.sha256))
            out[key] = gate.state if gate is not None else "shadow"
        return out

    async def drain(self) -> None:
        """Wait for the shadow answers in flight (tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        if self._rescan is not None:
            self._rescan.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *(t for t in [self._rescan] if t is not None), return_exceptions=True)
        await asyncio.to_thread(self.runner.close)
