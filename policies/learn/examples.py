"""Pairs as the edge model reads them: the chat-templated prompt and the answer, in the engine's own tokens.

The prompt is rendered with the GGUF's chat template and tokenised by llama.cpp, exactly as the
edge engine does for a chat request (edge_engine.engine: `render_chat`, no BOS added, special
tokens parsed); the answer is tokenised as plain text and closed by the token the template ends an
assistant turn with, so that the adapter also learns where to stop. Training puts its loss on the
answer's tokens only.

Needs no torch: the label set and the normalised answers are what the evaluation compares.
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from edge_engine.chat_template import ChatTemplate
from edge_engine.llama_model import LlamaModel
from policies.learn.pairs import Pair

MAX_LABELS = 20  # answers form a label set when at most this many distinct ones ...
LABEL_COVERAGE = 0.95  # ... cover at least this share of the pairs


@dataclass(frozen=True, slots=True)
class Example:
    """One pair in tokens: `prompt` ends with the assistant turn opened, `answer` with the end-of-turn token."""

    pair_id: str
    prompt: tuple[int, ...]
    answer: tuple[int, ...]
    text: str  # the upstream's answer

    @property
    def tokens(self) -> int:
        return len(self.prompt) + len(self.answer)


def normalise(text: str) -> str:
    """The answer as agreement compares it: NFKC, case-folded, whitespace collapsed, no closing period."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split()).rstrip(".!").strip()


def label_set(answers: Sequence[str], *, max_labels: int = MAX_LABELS, coverage: float = LABEL_COVERAGE) -> list[str] | None:
    """The labels the answers form, each as the upstream wrote it most often, most frequent first; None when
    the answers are free text (more than `max_labels` distinct answers needed to cover `coverage` of them,
    or a label seen once)."""
    if not answers:
        return None
    counts = Counter(normalise(a) for a in answers)
    top = [(label, n) for label, n in counts.most_common(max_labels) if n >= 2]
    if not top or sum(n for _, n in top) < coverage * len(answers):
        return None
    spelling: dict[str, Counter[str]] = {}
    for answer in answers:
        spelling.setdefault(normalise(answer), Counter())[answer.strip()] += 1
    return [spelling[label].most_common(1)[0][0] for label, _ in top]


class Tokenizer:
    """The edge model's vocabulary and chat template (llama.cpp, no weights loaded)."""

    def __init__(self, model_path: Path | None = None, *, model: LlamaModel | None = None) -> None:
        """The vocabulary of `model_path` (loaded alone), or of a model already loaded (`model`, not closed here)."""
        if model is None:
            assert model_path is not None, "name a model file or a loaded model"
        self._owned = model is None
        self.model = model if model is not None else LlamaModel(model_path, vocab_only=True)  # type: ignore[arg-type]
        self.template = ChatTemplate(self.model)
        closing = self.template.end_of_turn or self.model.eos_text
        self.end_of_turn = tuple(self.model.tokenize(closing, add_special=False, parse_special=True))

    def close(self) -> None:
        if self._owned:
            self.model.close()

    def prompt(self, messages: Sequence[dict[str, object]]) -> tuple[int, ...]:
        return tuple(self.model.tokenize(self.template.render(messages), add_special=False, parse_special=True))

    def answer(self, text: str) -> tuple[int, ...]:
        """The answer's tokens as the model would write them, then the end of its turn."""
        return (*self.model.tokenize(text, add_special=False, parse_special=False), *self.end_of_turn)

    def examples(self, pairs: Iterable[Pair], max_tokens: int) -> tuple[list[Example], int]:
        """The pairs as examples, and how many were left out for being longer than `max_tokens` in all."""
        out: list[Example] = []
        too_long = 0
        for pair in pairs:
            example = Example(pair_id=pair.pair_id, prompt=self.prompt(pair.messages), answer=self.answer(pair.answer),
                              text=pair.answer)  # fmt: skip
            if example.tokens > max_tokens:
                too_long += 1
                continue
            out.append(example)
        return out, too_long
