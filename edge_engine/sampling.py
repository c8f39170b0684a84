"""Per-request sampling parameters and the llama.cpp sampler chain built from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import cast

import llama_cpp


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


def build_sampler(params: SamplingParams, default_seed: int, n_vocab: int) -> llama_cpp.llama_sampler_p:
    """A sampler chain owned by one sequence; free it with llama_sampler_free."""
    chain = cast("llama_cpp.llama_sampler_p", llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params()))
    add = llama_cpp.llama_sampler_chain_add
    if params.repeat_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        add(chain, _penalties(n_vocab, params))
    if params.greedy:
        add(chain, llama_cpp.llama_sampler_init_greedy())
        return chain
    if params.top_k > 0:
        add(chain, llama_cpp.llama_sampler_init_top_k(params.top_k))
    if params.top_p < 1.0:
        add(chain, llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
    add(chain, llama_cpp.llama_sampler_init_temp(params.temperature))
    seed = default_seed if params.seed is None else params.seed
    add(chain, llama_cpp.llama_sampler_init_dist(seed & 0xFFFFFFFF))
    return chain
