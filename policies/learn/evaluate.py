"""The held-out pairs answered by the written artifact itself: llama.cpp, the base GGUF and the adapter file.

Scoring the file that will be served, rather than the torch model it was trained as, puts the
quantised base's rounding into the figures (the base is Q4_1 in llama.cpp, dequantised in torch)
and proves the file loads. A label template is scored by each label's sequence log-probability
(its tokens and the end of the turn) after the prompt, the prompt evaluated once; a free-text
template by its greedy answer, stopped at an end-of-generation token or the longest answer's length.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from policies.learn.calibration import Scored, label_probabilities
from policies.learn.examples import Example, Tokenizer, normalise


class Scorer:
    """The base model with an adapter (or none, for a baseline) in llama.cpp, every position's logits kept."""

    def __init__(self, base: Path, adapter: Path | None, n_ctx: int, threads: int | None = None) -> None:
        import llama_cpp

        threads = threads or max(1, os.cpu_count() or 1)
        self.llm: Any = llama_cpp.Llama(model_path=str(base), lora_path=str(adapter) if adapter else None, n_ctx=n_ctx,
                                        n_batch=min(n_ctx, 512), logits_all=True, n_threads=threads,
                                        n_threads_batch=threads, verbose=False)  # fmt: skip

    def close(self) -> None:
        self.llm.close()

    def _logprob(self, position: int, token: int) -> float:
        row = np.asarray(self.llm.scores[position], dtype=np.float64)
        peak = row.max()
        return float(row[token] - peak - np.log(np.exp(row - peak).sum()))

    def continuations(self, prompt: Sequence[int], options: Sequence[Sequence[int]]) -> list[float]:
        """Each option's summed log-probability after `prompt`."""
        self.llm.reset()
        self.llm.eval(list(prompt))
        out: list[float] = []
        for option in options:
            self.llm.n_tokens = len(prompt)  # drop the previous option; eval clears its cache entries
            self.llm.eval(list(option))
            out.append(sum(self._logprob(len(prompt) - 1 + i, t) for i, t in enumerate(option)))
        return out

    def greedy(self, prompt: Sequence[int], max_new: int, stop: frozenset[int]) -> tuple[list[int], float]:
        """The greedy answer's tokens (without the stop token) and the mean log-probability of all it chose."""
        self.llm.reset()
        self.llm.eval(list(prompt))
        tokens: list[int] = []
        logprobs: list[float] = []
        for _ in range(max_new):
            position = self.llm.n_tokens - 1
            token = int(np.argmax(self.llm.scores[position]))
            logprobs.append(self._logprob(position, token))
            if token in stop:
                break
            tokens.append(token)
            if self.llm.n_tokens >= self.llm.n_ctx():
                break
            self.llm.eval([token])
        return tokens, float(np.mean(logprobs)) if logprobs else float("-inf")


def score_labels(scorer: Scorer, tokenizer: Tokenizer, held_out: Sequence[Example], labels: Sequence[str]) -> list[Scored]:
    """Each held-out pair's most probable label, that label's probability among the labels, and agreement."""
    options = [tokenizer.answer(label) for label in labels]
    out: list[Scored] = []
    for example in held_out:
        probs = label_probabilities(scorer.continuations(example.prompt, options))
        best = int(np.argmax(probs))
        out.append(Scored(pair_id=example.pair_id, answer=labels[best], confidence=probs[best],
                          agrees=normalise(labels[best]) == normalise(example.text)))  # fmt: skip
    return out


def score_text(scorer: Scorer, tokenizer: Tokenizer, held_out: Sequence[Example], max_new: int) -> list[Scored]:
    """Each held-out pair's greedy answer, its mean token log-probability, and exact agreement once normalised."""
    stop = tokenizer.model.end_of_generation_tokens() | frozenset(tokenizer.end_of_turn)
    out: list[Scored] = []
    for example in held_out:
        tokens, confidence = scorer.greedy(example.prompt, max_new, stop)
        text = scorer.llm.detokenize(tokens).decode("utf-8", errors="replace")
        out.append(Scored(pair_id=example.pair_id, answer=text, confidence=confidence,
                          agrees=normalise(text) == normalise(example.text)))  # fmt: skip
    return out
