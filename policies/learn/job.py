"""`tierlane edge learn`'s work: per template, its pairs -> a LoRA adapter GGUF named by its sha256 and a manifest.

For each (tenant, app, template) asked: the pairs of the template's newest definition (version), the
store's fixed held-out split kept aside; fewer than the learn section's `min_pairs` and nothing is
written. Then: train on the rest (trainer), write `<out>/<tenant>/<app>/<template>/<sha256>.gguf`
(adapter), answer the held-out pairs with that file in llama.cpp (evaluate), and write
`<sha256>.json` beside it: what was trained on, how, how well it agrees with the upstream, and the
confidence threshold for the serving step. The base model is loaded once for all templates.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from policies.learn.calibration import Scored, threshold
from policies.learn.config import LearnSection
from policies.learn.examples import Tokenizer, label_set
from policies.learn.pairs import Pair, PairReader
from policies.learn.trainer import Hyper

log = logging.getLogger(__name__)

MANIFEST_FORMAT = 1
METHOD = "lora"


class NotEnoughPairs(Exception):
    """A template has fewer pairs than the learn section's min_pairs (or none held out): nothing is written."""


@dataclass(frozen=True, slots=True)
class Plan:
    """One template to train: its pairs read and counted."""

    tenant: str
    app: str
    template: str
    version: str
    train: list[Pair]
    held_out: list[Pair]
    section: LearnSection


@dataclass(frozen=True, slots=True)
class Written:
    """What a run wrote for one template."""

    artifact: Path
    manifest: Path
    summary: dict[str, Any]


def plan(reader: PairReader, tenant: str, app: str, template: str, section: LearnSection) -> Plan:
    """The template's pairs of its newest definition, split; NotEnoughPairs below `section.min_pairs`."""
    newest = next(reader.pairs(tenant, app, template, page=1), None)
    where = f"template {template!r} of {tenant}/{app}"
    if newest is None:
        raise NotEnoughPairs(f"{where}: no pairs kept (is it named in the learn policy, and has it been answered?)")
    version = newest.template_version
    train = list(reader.pairs(tenant, app, template, split="train", version=version))
    held_out = list(reader.pairs(tenant, app, template, split="held_out", version=version))
    total = len(train) + len(held_out)
    if total < section.min_pairs:
        raise NotEnoughPairs(f"{where}: {total} pairs of its current definition (version {version}), fewer than "
                             f"min_pairs {section.min_pairs} (the learn policy section): collect more, or lower min_pairs")  # fmt: skip
    if not held_out or not train:
        raise NotEnoughPairs(f"{where}: {len(train)} training and {len(held_out)} held-out pairs: both sides need one")
    return Plan(tenant=tenant, app=app, template=template, version=version, train=train, held_out=held_out, section=section)


class Learner:
    """The base model, loaded once (torch for training, its GGUF for llama.cpp), and what trains on it."""

    def __init__(self, base_path: Path, *, progress: bool = True, threads: int | None = None) -> None:
        import torch

        from policies.artifact_dir import sha256_file
        from policies.learn.base_model import load_base

        # NOTE: torch's thread count is the process's; a learner sets it once for training and llama.cpp alike.
        # On shared cores fewer threads go faster: two threads on two busy cores ran 5x slower than one.
        if threads is not None:
            torch.set_num_threads(threads)
        self.threads = torch.get_num_threads()
        self.base_path = base_path
        self.base_sha256 = sha256_file(base_path)
        started = time.perf_counter()
        self.model, self.shape = load_base(base_path)
        self.load_seconds = time.perf_counter() - started
        self.tokenizer = Tokenizer(base_path)
        self.progress = progress

    def close(self) -> None:
        self.tokenizer.close()

    def learn(self, job: Plan, hyper: Hyper, out_dir: Path, *, budget_s: float | None = None,
              max_eval: int = 500) -> Written:  # fmt: skip
        """Train, write the adapter and its manifest, evaluate; the paths written."""
        from policies.learn.adapter import write_adapter
        from policies.learn.evaluate import Scorer, score_labels, score_text
        from policies.learn.trainer import train

        tokenizer = self.tokenizer
        labels = label_set([p.answer for p in job.train])
        examples, too_long = tokenizer.examples(job.train, hyper.max_tokens)
        held_out, held_too_long = tokenizer.examples(job.held_out[:max_eval], hyper.max_tokens)
        if not examples or not held_out:
            raise NotEnoughPairs(f"template {job.template!r} of {job.tenant}/{job.app}: every pair is longer than "
                                 f"max_tokens {hyper.max_tokens}")  # fmt: skip
        eos: Any = self.model.config.eos_token_id
        pad = int(eos[0] if isinstance(eos, list) else eos or 0)
        trained = train(self.model, examples, hyper, budget_s=budget_s, pad=pad, progress=self.progress)
        directory = out_dir / quote(job.tenant, safe="") / quote(job.app, safe="") / job.template
        artifact, sha = write_adapter(trained.weights, self.shape, hyper.alpha, directory,
                                      name=f"{job.template} ({job.tenant}/{job.app})")  # fmt: skip
        longest = max(len(e.answer) for e in examples)
        started = time.perf_counter()
        scorer = Scorer(self.base_path, artifact, n_ctx=max(e.tokens for e in held_out) + longest + 16, threads=self.threads)
        try:
            if labels is not None:
                scored = score_labels(scorer, tokenizer, held_out, labels)
            else:
                scored = score_text(scorer, tokenizer, held_out, max_new=longest + 8)
        finally:
            scorer.close()
        eval_seconds = time.perf_counter() - started
        manifest = self._manifest(job, hyper, trained, artifact, sha, labels, scored, eval_seconds=eval_seconds,
                                  too_long=too_long + held_too_long, answer_tokens=longest)  # fmt: skip
        manifest_path = directory / f"{sha}.json"
        part = directory / f".{os.getpid()}.json.part"
        part.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        os.replace(part, manifest_path)
        summary = {k: manifest[k] for k in ("tenant", "app", "template", "sha256")}
        summary |= {"artifact": str(artifact), "agreement": manifest["evaluation"]["agreement"],
                    "threshold": manifest["confidence"]["threshold"], "coverage": manifest["confidence"]["coverage"],
                    "train_seconds": manifest["training"]["seconds"]}  # fmt: skip
        return Written(artifact=artifact, manifest=manifest_path, summary=summary)

    def _manifest(self, job: Plan, hyper: Hyper, trained: Any, artifact: Path, sha: str, labels: list[str] | None,
                  scored: Sequence[Scored], *, eval_seconds: float, too_long: int,
                  answer_tokens: int) -> dict[str, Any]:  # fmt: skip
        bound = threshold(scored, job.section.threshold_disagreement)
        agreement = sum(s.agrees for s in scored) / len(scored)
        return {
            "format": MANIFEST_FORMAT,
            "artifact": artifact.name,
            "sha256": sha,
            "bytes": artifact.stat().st_size,
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "tenant": job.tenant,
            "app": job.app,
            "template": job.template,
            "template_version": job.version,
            "base_model": {"path": str(self.base_path), "sha256": self.base_sha256, "architecture": self.shape.architecture},
            "pairs": {"train": len(job.train), "held_out": len(job.held_out), "held_out_evaluated": len(scored),
                      "left_out_too_long": too_long},  # fmt: skip
            "training": {
                "method": METHOD,
                "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                "trainable_parameters": sum(a.size + b.size for a, b in trained.weights.values()),
                "seed": hyper.seed,
                "hyper": hyper.as_dict(),
                "steps": trained.steps,
                "planned_steps": trained.planned_steps,
                "stopped_by": trained.stopped_by,
                "seconds": round(trained.seconds, 2),
                "base_load_seconds": round(self.load_seconds, 2),
                "tokens": trained.tokens,
                "tokens_per_s": round(trained.tokens / trained.seconds, 1) if trained.seconds > 0 else None,
                "threads": self.threads,
                "loss_first": trained.losses[0],
                "loss_last": trained.losses[-1],
                "losses": [round(x, 5) for x in trained.losses],
            },
            "evaluation": {
                "by": "llama.cpp, the base GGUF with this adapter",
                "kind": "labels" if labels is not None else "exact_match",
                "agreement": agreement,
                "seconds": round(eval_seconds, 2),
            },
            "confidence": {
                "kind": "label_probability" if labels is not None else "mean_token_logprob",
                "labels": labels,
                "answer_tokens_max": answer_tokens,  # the longest training answer, end of turn included
                "threshold_disagreement": job.section.threshold_disagreement,
                "target_agreement": bound.target_agreement,
                "threshold": bound.threshold,
                "coverage": bound.coverage,
                "agreement_at_threshold": bound.agreement,
                # the chosen label per pair; a free-text answer is not kept (it may repeat the tenant's data)
                "held_out": [{"pair_id": s.pair_id, "confidence": s.confidence, "agrees": s.agrees}
                             | ({"label": s.answer} if labels is not None else {}) for s in scored],  # fmt: skip
            },
        }
