"""Per-request sampling parameters and the llama.cpp sampler chain built from them."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, cast

import llama_cpp
import numpy as np
import numpy.typing as npt

from edge_engine.errors import InvalidInput

MAX_TOP_LOGPROBS = 20
# llama_token_data, as numpy lays it out: filled from a logits row without a Python loop
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class Priority(IntEnum):
    """Queue order: interactive requests are admitted before batch ones."""

    INTERACTIVE = 0
    BATCH = 1


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """What a request asks of the sampler; temperature 0 means greedy."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    repeat_penalty: float = 1.0  # 1.0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    top_logprobs: int = 0  # most likely tokens reported with each sampled one (0..MAX_TOP_LOGPROBS)
    stop_on_loop: bool = True  # end a sequence that repeats itself with finish_reason "loop"
    # end a sequence after this many tokens in a row below low_confidence_logprob (0: off); the
    # log-probability is the raw model's, so tokens a grammar forces against the model count as low
    low_confidence_run: int = 0
    low_confidence_logprob: float = -4.0
    grammar: str | None = None  # GBNF (root rule "root") the output must follow, e.g. json_mode.grammar_for

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def _penalties(n_vocab: int, params: SamplingParams) -> llama_cpp.llama_sampler_p:
    # NOTE: llama.cpp dropped `n_vocab` from llama_sampler_init_penalties at one point and the
    # bundled build still takes it; follow the arity of the installed binding, not a guess.
    init = llama_cpp.llama_sampler_init_penalties
    values = (params.penalty_last_n, params.repeat_penalty, params.frequency_penalty, params.presence_penalty)
    if len(getattr(init, "argtypes", None) or ()) == 5:
        return cast("llama_cpp.llama_sampler_p", init(n_vocab, *values))
    return cast("llama_cpp.llama_sampler_p", init(*values))


def grammar_sampler(vocab: llama_cpp.llama_vocab_p, grammar: str) -> llama_cpp.llama_sampler_p:
    """A grammar sampler (root rule "root"); InvalidInput when llama.cpp cannot parse the grammar."""
    if "\x00" in grammar:  # a C string: llama.cpp would see only the part before it
        raise InvalidInput("the grammar for this request contains a NUL character", param="response_format")
    sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), b"root")
    if not sampler:  # NOTE: llama.cpp logs the parse error and returns NULL; it never aborts here
        raise InvalidInput("the grammar for this request could not be parsed", param="response_format")
    return cast("llama_cpp.llama_sampler_p", sampler)


def check_grammar(vocab: llama_cpp.llama_vocab_p, grammar: str | None) -> None:
    """Raises InvalidInput for a grammar llama.cpp cannot use (a parse takes well under a millisecond)."""
    if grammar:
        llama_cpp.llama_sampler_free(grammar_sampler(vocab, grammar))


class Sampler:
    """One sequence's sampling: a llama.cpp chain and, for a grammar, the grammar kept beside it.

    NOTE: a grammar inside the chain checks every token of the vocabulary at every step (15-20
    ms per token for SmolLM2's 49k tokens with the JSON grammar, on one thread: about what
    decoding the token costs; bench/edge_confidence_cost.py). As in
    llama.cpp's own common sampler, the chain picks first and the grammar checks only that
    token; the whole vocabulary is filtered only when the pick is not allowed. The greedy pick
    is the same token; a sampled one comes from the same distribution (the allowed tokens'
    probabilities renormalised), by another draw of the generator.
    """

    def __init__(self, chain: llama_cpp.llama_sampler_p, grammar: llama_cpp.llama_sampler_p | None, n_vocab: int) -> None:
        self.chain = chain
        self.grammar = grammar
        self.rejected = 0  # picks the grammar refused (each cost a full-vocabulary pass)
        if grammar is not None:
            self._ids = np.arange(n_vocab, dtype=np.int32)
            self._cur = np.zeros(n_vocab, dtype=_TOKEN_DATA)
            self._array = llama_cpp.llama_token_data_array(
                self._cur.ctypes.data_as(llama_cpp.llama_token_data_p), n_vocab, -1, False
            )
            self._one = np.zeros(1, dtype=_TOKEN_DATA)
            self._single = llama_cpp.llama_token_data_array(
                self._one.ctypes.data_as(llama_cpp.llama_token_data_p), 1, -1, False
            )

    def sample(self, ctx: llama_cpp.llama_context_p, index: int, logits: Callable[[int], npt.NDArray[np.float32]]) -> int:
        """Samples from batch row `index` and records the token (`logits` reads a row in place)."""
        if self.grammar is None:
            return int(llama_cpp.llama_sampler_sample(self.chain, ctx, index))
        row = logits(index)
        token = self._pick(row, with_grammar=False)
        self._one[0] = (token, 1.0, 0.0)
        self._single.size, self._single.selected = 1, -1
        llama_cpp.llama_sampler_apply(self.grammar, ctypes.byref(self._single))
        if self._one["logit"][0] == -math.inf:
            self.rejected += 1
            token = self._pick(row, with_grammar=True)
        llama_cpp.llama_sampler_accept(self.grammar, token)
        llama_cpp.llama_sampler_accept(self.chain, token)
        return token

    def _pick(self, row: npt.NDArray[np.float32], with_grammar: bool) -> int:
        cur, array = self._cur, self._array
        cur["id"] = self._ids
        cur["logit"] = row
        cur["p"] = 0.0
        # the chain may shrink `size` (top-k) or, in principle, point `data` elsewhere: reset both
        array.data = cast(Any, cur.ctypes.data_as(llama_cpp.llama_token_data_p))
        array.size, array.selected, array.sorted = cur.shape[0], -1, False
        if with_grammar:
            assert self.grammar is not None
            llama_cpp.llama_sampler_apply(self.grammar, ctypes.byref(array))
        llama_cpp.llama_sampler_apply(self.chain, ctypes.byref(array))
        if not 0 <= array.selected < array.size:
            raise RuntimeError("the sampler chain selected no token")
        return int(array.data[array.selected].id)

    def close(self) -> None:
        for sampler in (self.chain, self.grammar):
            if sampler is not None:
                llama_cpp.llama_sampler_free(sampler)
        self.chain = self.grammar = None  # type: ignore[assignment]


def build_sampler(
    params: SamplingParams, default_seed: int, n_vocab: int, vocab: llama_cpp.llama_vocab_p | None = None
) -> Sampler:
    """The sampler of one sequence; close() it when the sequence ends.

    `vocab` is needed for a grammar; an unparsable one raises InvalidInput (nothing is leaked).
    """
    grammar = None
    if params.grammar:
        if vocab is None:
            raise ValueError("a grammar needs the model's vocabulary")
        grammar = grammar_sampler(vocab, params.grammar)
    chain = cast("llama_cpp.llama_sampler_p", llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params()))
    add = llama_cpp.llama_sampler_chain_add
    if params.repeat_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        add(chain, _penalties(n_vocab, params))
    if params.greedy:
        add(chain, llama_cpp.llama_sampler_init_greedy())
        return Sampler(chain, grammar, n_vocab)
    if params.top_k > 0:
        add(chain, llama_cpp.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1.0:
        add(chain, llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
    add(chain, llama_cpp.llama_sampler_init_temp(params.temperature))
    seed = default_seed if params.seed is None else params.seed
    add(chain, llama_cpp.llama_sampler_init_dist(seed & 0xFFFFFFFF))
    return Sampler(chain, grammar, n_vocab)
