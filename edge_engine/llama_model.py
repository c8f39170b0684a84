"""Thin ctypes wrappers over llama.cpp: the model (weights, vocabulary, template) and one context."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
import numpy.typing as npt

from edge_engine.sampling import Sampler

_GGML_TYPES = {
    "f32": llama_cpp.GGML_TYPE_F32,
    "f16": llama_cpp.GGML_TYPE_F16,
    "q8_0": llama_cpp.GGML_TYPE_Q8_0,
    "q4_0": llama_cpp.GGML_TYPE_Q4_0,
}

log = logging.getLogger(__name__)
llama_log = logging.getLogger("edge_engine.llama_cpp")

# ggml_log_level as this llama.cpp defines it (ggml.h: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5).
# NOTE: llama-cpp-python's own log filter still maps the older numbering (INFO 1, WARN 2), so with
# it set to warnings every info line went out: its callback is replaced by this one.
_WARN, _ERROR, _CONT = 3, 4, 5
_last_level = 0


@llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
def _forward_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp's log, warnings and errors only, through Python logging (its info lines are dropped).

    NOTE: a request's grammar or prompt never reaches this log at info level; llama.cpp prints a
    grammar it fails to parse straight to stderr, which the bounds of edge_engine/grammar.py keep small.
    """
    global _last_level
    if level != _CONT:
        _last_level = level
    if _last_level in (_WARN, _ERROR):
        message = text.decode("utf-8", errors="replace").rstrip()
        if message:
            llama_log.log(logging.WARNING if _last_level == _WARN else logging.ERROR, "%s", message[:2000])


def quiet_llama_log() -> None:
    """Routes llama.cpp's log through `_forward_log` (kept alive at module level, as ctypes needs)."""
    llama_cpp.llama_log_set(_forward_log, ctypes.c_void_p(0))


class LlamaModel:
    """Loaded GGUF weights and vocabulary; tokenising only reads the vocabulary, so it is thread-safe."""

    def __init__(self, path: Path, n_gpu_layers: int = 0, extra_buffers: bool = False, vocab_only: bool = False) -> None:
        quiet_llama_log()
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.vocab_only = vocab_only
        # NOTE: extra buffer types repack weights for AMX/AVX512 kernels; a native build on a
        # CPU that reports AMX faults in ggml_backend_amx_mul_mat where the OS denies AMX tiles.
        params.use_extra_bufts = extra_buffers
        self.path = path
        self.ptr = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            raise RuntimeError(f"llama.cpp could not load the model {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.ptr)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self.ptr)
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self._pieces: dict[int, bytes] = {}
        # tokens that also end generation: the stop set the engine derives at start (chat_template.stop_tokens)
        self.extra_stop_tokens: frozenset[int] = frozenset()

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_model_free(self.ptr)
            self.ptr = None

    def metadata(self, key: str) -> str | None:
        size = 1 << 16
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_model_meta_val_str(self.ptr, key.encode(), buf, size)
        if n < 0:
            return None
        if n >= size:
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self.ptr, key.encode(), buf, n + 1)
        return buf.value.decode("utf-8", errors="replace")

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        tokens = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), tokens, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            tokens = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), tokens, cap, add_special, parse_special)
        return list(tokens[:n])

    def piece(self, token: int) -> bytes:
        """The bytes a token stands for (special tokens render as nothing)."""
        cached = self._pieces.get(token)
        if cached is None:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, -n, 0, False)
            cached = buf.raw[:n]
            self._pieces[token] = cached
        return cached

    def token_text(self, token: int) -> str:
        raw = llama_cpp.llama_vocab_get_text(self.vocab, token)
        return raw.decode("utf-8", errors="replace") if raw else ""

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token)) or token in self.extra_stop_tokens

    def end_of_generation_tokens(self) -> frozenset[int]:
        """Every token llama.cpp ends generation on (EOS, EOT, EOM and end-of-turn tokens it knows by name)."""
        return frozenset(t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t))

    def is_special(self, token: int) -> bool:
        """A control or user-defined token (written by templates, never by plain text)."""
        attr = llama_cpp.llama_vocab_get_attr(self.vocab, token)
        return bool(attr & (llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED))

    @property
    def bos_text(self) -> str:
        return self.token_text(llama_cpp.llama_vocab_bos(self.vocab))

    @property
    def eos_text(self) -> str:
        return self.token_text(llama_cpp.llama_vocab_eos(self.vocab))


@dataclass(slots=True)
class BatchEntry:
    """One token of a step: which sequence, at which position, and whether we need its logits."""

    token: int
    pos: int
    seq_id: int
    logits: bool


class LlamaContext:
    """A llama.cpp context and its KV cache; used only by the scheduler thread.

    `per_sequence_streams`: one KV stream of `n_ctx` cells per sequence id (batch-invariant
    numerics); otherwise one unified pool of `n_ctx` cells shared by all sequences.
    """

    def __init__(
        self,
        model: LlamaModel,
        *,
        n_ctx: int,
        n_batch: int,
        n_seq_max: int,
        n_threads: int,
        flash_attn: bool,
        kv_cache_type: str = "f16",
        per_sequence_streams: bool = True,
    ) -> None:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_ctx * n_seq_max if per_sequence_streams else n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch
        params.n_seq_max = n_seq_max
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        # NOTE: attention sums over KV cells in cell-index order, in SIMD lanes and chunks
        # fixed by the index. In a unified pool a sequence's cells land wherever other
        # requests left room, so its logits change with traffic (measured up to ~1.0). With a
        # stream per sequence its cells always start at index 0 and masked cells of a longer
        # neighbour add exact zeros, so logits are bit-identical alone, batched, or after a
        # prefix copy (matmuls on CPU are row-independent: one row = one dot per output).
        params.kv_unified = not per_sequence_streams
        # NOTE: CPU flash attention picks tiled / split-KV kernels by the query count and the
        # padded KV length of the whole step, so it breaks batch invariance; keep it off there.
        params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        params.type_k = params.type_v = _GGML_TYPES[kv_cache_type]
        params.no_perf = True
        self.model = model
        self.ptr = llama_cpp.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise RuntimeError("llama.cpp could not create a context (out of memory?)")
        self.per_sequence_streams = per_sequence_streams
        self.n_ctx_total = llama_cpp.llama_n_ctx(self.ptr)
        self.n_ctx = llama_cpp.llama_n_ctx_seq(self.ptr)  # cells one sequence may use
        self.n_batch = n_batch
        self.memory = llama_cpp.llama_get_memory(self.ptr)
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        if self.ptr:
            llama_cpp.llama_batch_free(self.batch)
            llama_cpp.llama_free(self.ptr)
            self.ptr = None

    def decode(self, entries: list[BatchEntry]) -> int:
        """Runs one forward pass over all entries; returns llama_decode's status (0: ok)."""
        b = self.batch
        for i, e in enumerate(entries):
            b.token[i] = e.token
            b.pos[i] = e.pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = e.seq_id
            b.logits[i] = 1 if e.logits else 0
        b.n_tokens = len(entries)
        return int(llama_cpp.llama_decode(self.ptr, b))

    def logits(self, index: int) -> npt.NDArray[np.float32]:
        """The logits of batch row `index`, read in place: valid until the next decode."""
        ptr = llama_cpp.llama_get_logits_ith(self.ptr, index)
        if not ptr:
            raise RuntimeError(f"llama.cpp has no logits for batch row {index}")
        address = ctypes.cast(ptr, ctypes.c_void_p).value
        assert address is not None
        return np.frombuffer((ctypes.c_float * self.model.n_vocab).from_address(address), dtype=np.float32)

    def sample(self, sampler: Sampler, index: int) -> int:
        """Samples from the logits of batch row `index` (also records the token in the sampler)."""
        return sampler.sample(self.ptr, index, self.logits)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> None:
        llama_cpp.llama_memory_seq_rm(self.memory, seq_id, p0, p1)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Makes `dst` hold the first `n` positions of `src`, in the cells a fresh run would use."""
        self.seq_rm(dst)
        if not self.per_sequence_streams:
            # same stream: the cells are tagged with dst too, nothing is copied
            llama_cpp.llama_memory_seq_cp(self.memory, src, dst, 0, n)
            return
        # NOTE: seq_cp across streams copies the whole stream buffer (n_ctx cells, every layer);
        # the state API copies only the cells src uses and lays them out from index 0 in dst,
        # as in src, so the copy is exact and costs one KV cell per token (12-23 KB for SmolLM2-135M).
        size = llama_cpp.llama_state_seq_get_size(self.ptr, src)
        buf = (ctypes.c_uint8 * size)()
        if llama_cpp.llama_state_seq_get_data(self.ptr, buf, size, src) == 0:
            raise RuntimeError(f"llama.cpp could not read the KV state of sequence {src}")
        if llama_cpp.llama_state_seq_set_data(self.ptr, buf, size, dst) == 0:
            raise RuntimeError(f"llama.cpp could not restore a KV state into sequence {dst}")
        self.seq_rm(dst, n, -1)

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self.memory, True)
