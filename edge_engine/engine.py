"""The edge engine as the gateway sees it: async submit/stream/cancel over the scheduler thread.

The engine supervises its scheduler: when the scheduler thread ends on a failure (it has
already failed every request it held), the engine reports itself unavailable, answers new
submissions with EngineBusy at once, and starts a fresh scheduler over the same loaded model,
with backoff between attempts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from collections.abc import Sequence as Seq
from typing import Any

from edge_engine.chat_template import ChatTemplate, stop_tokens
from edge_engine.errors import ContextTooLong, EngineBusy, InvalidInput
from edge_engine.events import GenerationEvent, Sequence
from edge_engine.grammar import GrammarCompiler
from edge_engine.llama_model import LlamaModel
from edge_engine.sampling import MAX_TOP_LOGPROBS, Priority, SamplingParams, check_grammar
from edge_engine.scheduler import Scheduler
from edge_engine.settings import EdgeSettings
from edge_engine.stats import EngineStats

log = logging.getLogger(__name__)

RESTART_DELAY_S = 0.5  # first wait before a failed scheduler is replaced; doubles per failed start
RESTART_DELAY_MAX_S = 30.0


class Generation:
    """One submitted request: iterate it for events; `cancel()` frees its slot and KV cells."""

    def __init__(self, scheduler: Scheduler, seq: Sequence, queue: asyncio.Queue[GenerationEvent | BaseException]) -> None:
        self._scheduler = scheduler
        self._seq = seq
        self._queue = queue
        self._done = False
        self.prompt_tokens = len(seq.prompt)

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> GenerationEvent:
        if self._done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finish_reason is not None:
            self._done = True
        return item

    @property
    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._scheduler.cancel(self._seq)

    async def aclose(self) -> None:
        self.cancel()


class EdgeEngine:
    """An embedded llama.cpp model with continuous batching; start() before use, close() after."""

    def __init__(self, settings: EdgeSettings | None = None, chat_template: str | None = None) -> None:
        """`chat_template`: Jinja text used instead of the GGUF's own (for a GGUF that carries none)."""
        self.settings = settings or EdgeSettings()
        self._chat_template_text = chat_template
        self._stats = EngineStats()
        self._scheduler: Scheduler | None = None
        self._model: LlamaModel | None = None
        self._template: ChatTemplate | None = None
        self._n_ctx = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._restarting: asyncio.Task[None] | None = None
        self._closing = False
        # every grammar reaches llama.cpp through it: bounded, off the loop and the scheduler thread, cached
        self.grammars = GrammarCompiler(self.settings.grammar, parse=self._parse_grammar)

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    @property
    def n_ctx(self) -> int:
        """Longest prompt plus completion one request may use, in tokens."""
        return self._n_ctx

    @property
    def available(self) -> bool:
        """Whether a request submitted now would be taken (false while the scheduler restarts)."""
        return self._scheduler is not None and self._scheduler.running

    async def start(self) -> None:
        """Loads the model, then creates the context on a scheduler thread."""
        logging.getLogger("llama-cpp-python").setLevel(logging.WARNING)
        self._loop = asyncio.get_running_loop()
        s = self.settings
        self._model = await asyncio.to_thread(LlamaModel, s.resolved_model_path(), s.n_gpu_layers, s.extra_buffers)
        try:
            # a template the engine cannot render is a start-up error naming the file (ChatTemplateError)
            self._template = await asyncio.to_thread(ChatTemplate, self._model, self._chat_template_text)
            self._model.extra_stop_tokens = await asyncio.to_thread(stop_tokens, self._model, self._template)
            await self._start_scheduler()
        except BaseException:
            self._model.close()
            self._model = None
            raise
        log.info("edge engine ready: %s, %d KV cells, %d slots", self._model.path.name, self._n_ctx, self.settings.slots)

    async def _start_scheduler(self) -> None:
        assert self._loop is not None and self._model is not None
        loop = self._loop
        scheduler = Scheduler(self.settings, self._stats, self._model)
        ready: asyncio.Future[BaseException | None] = loop.create_future()
        def on_ready(exc: BaseException | None) -> None:
            loop.call_soon_threadsafe(ready.set_result, exc)

        def on_exit(exc: BaseException | None) -> None:
            loop.call_soon_threadsafe(self._on_exit, scheduler, exc)

        scheduler.start(on_ready, on_exit)
        error = await ready
        if error is not None:
            raise error
        assert scheduler.ctx is not None
        self._scheduler = scheduler
        self._n_ctx = min(scheduler.ctx.n_ctx, self._model.n_ctx_train or scheduler.ctx.n_ctx)

    def _on_exit(self, scheduler: Scheduler, failure: BaseException | None) -> None:
        """On the event loop: a scheduler thread ended; replace it unless the engine is closing."""
        if self._closing or scheduler is not self._scheduler or failure is None:
            return
        log.error("the edge scheduler stopped on %r; the edge lane is unavailable until a fresh one starts", failure)
        self._restarting = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        delay = RESTART_DELAY_S
        while not self._closing:
            await asyncio.sleep(delay)
            try:
                await self._start_scheduler()
            except Exception:
                log.exception("starting a fresh edge scheduler failed; next try in %.1f s", delay * 2)
                delay = min(RESTART_DELAY_MAX_S, delay * 2)
                continue
            self._stats.restarts_total += 1
            log.warning("edge engine restarted (%d restarts so far)", self._stats.restarts_total)
            return

    async def close(self) -> None:
        self._closing = True
        self.grammars.close()
        if self._restarting is not None:
            self._restarting.cancel()
            await asyncio.gather(self._restarting, return_exceptions=True)
        if self._scheduler is not None:
            await asyncio.to_thread(self._scheduler.stop)
        if self._model is not None:
            self._model.close()
            self._model = None

    def _parse_grammar(self, grammar: str) -> None:
        """llama.cpp's own parse of a grammar that passed the bounds (on the compiler's thread)."""
        check_grammar(self._loaded().vocab, grammar)

    async def compile_grammar(self, response_format: Mapping[str, Any] | None) -> str | None:
        """The grammar of a `response_format` (None: plain text), bounded and parsed by llama.cpp, cached.

        Raises InvalidInput for one the edge cannot express, GrammarTooComplex past edge.grammar.
        """
        return await self.grammars.compile(response_format)

    def count_tokens(self, text: str) -> int:
        """Tokens `text` takes in this model's vocabulary; safe from any thread."""
        return len(self._loaded().tokenize(text, add_special=False, parse_special=False))

    def render_chat(self, messages: Seq[Mapping[str, Any]]) -> str:
        """The prompt text the chat template makes of `messages`."""
        assert self._template is not None, "EdgeEngine.start() first"
        return self._template.render(messages)

    def tokenize_request(self, *, messages: Seq[Mapping[str, Any]] | None = None, prompt: Any = None) -> list[int]:
        """Prompt tokens for a chat or a completion request (blocking: call off the event loop)."""
        model = self._loaded()
        if messages is not None:
            # the template writes its own special tokens, so no BOS is added here
            return model.tokenize(self.render_chat(messages), add_special=False, parse_special=True)
        if isinstance(prompt, str):
            return model.tokenize(prompt, add_special=True, parse_special=True)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            if any(t < 0 or t >= model.n_vocab for t in prompt):
                raise InvalidInput(f"prompt token ids must be in [0, {model.n_vocab})", param="prompt")
            return list(prompt)
        raise InvalidInput("the edge model takes one prompt: a string or a list of token ids", param="prompt")

    async def submit(
        self,
        *,
        messages: Seq[Mapping[str, Any]] | None = None,
        prompt: Any = None,
        params: SamplingParams | None = None,
        priority: Priority = Priority.INTERACTIVE,
        prompt_tokens: list[int] | None = None,
        scope: str = "",
    ) -> Generation:
        """Queues a request; raises InvalidInput / ContextTooLong or EngineBusy at once.

        `scope` keys KV prefix reuse: only requests of the same scope share cached prompt cells.
        """
        params = params or SamplingParams()
        if not self.available:
            raise EngineBusy("the edge engine is restarting after a failure; retry shortly", retry_after=2)
        enqueued_at = time.perf_counter()
        tokens = prompt_tokens
        if tokens is None:
            tokens = await asyncio.to_thread(self.tokenize_request, messages=messages, prompt=prompt)
        param = "messages" if messages is not None else "prompt"
        if not tokens:
            raise InvalidInput("the prompt is empty", param=param)
        if len(tokens) >= self._n_ctx:
            raise ContextTooLong(
                f"This model's maximum context length is {self._n_ctx} tokens. However, your "
                f"{param} resulted in {len(tokens)} tokens. Please shorten it.",
                param=param,
            )
        room = self._n_ctx - len(tokens)
        wanted = params.max_tokens if params.max_tokens is not None else self.settings.default_max_tokens
        if wanted < 1:
            raise InvalidInput("max_tokens must be at least 1", param="max_tokens")
        if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidInput(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
        if params.low_confidence_run < 0:
            raise InvalidInput("low_confidence_run must be 0 (off) or more", param="low_confidence_run")
        if params.grammar and not self.grammars.known(params.grammar):
            # NOTE: a grammar given as text gets the same bounds and parse as a compiled one, off the
            # scheduler thread, so a bad one is a 400 before any stream starts
            await self.grammars.verify(params.grammar)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[GenerationEvent | BaseException] = asyncio.Queue()

        def deliver(item: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        seq = Sequence(
            prompt=tokens,
            params=params,
            max_new=min(wanted, room),
            priority=priority,
            deliver=deliver,
            enqueued_at=enqueued_at,
            scope=scope,
        )
        scheduler = self._scheduler
        assert scheduler is not None
        scheduler.submit(seq)
        return Generation(scheduler, seq, queue)

    async def generate(
        self,
        *,
        messages: Seq[Mapping[str, Any]] | None = None,
        prompt: Any = None,
        params: SamplingParams | None = None,
        priority: Priority = Priority.INTERACTIVE,
        scope: str = "",
    ) -> AsyncIterator[GenerationEvent]:
        """Events as tokens are sampled; closing the iterator early cancels the sequence."""
        generation = await self.submit(messages=messages, prompt=prompt, params=params, priority=priority, scope=scope)
        try:
            async for event in generation:
                yield event
        finally:
            generation.cancel()

    def expected_seconds(self, prompt_tokens: int, output_tokens: int) -> float | None:
        """How long an answer of this size takes here when nothing else runs (None: not measured yet)."""
        scheduler = self._scheduler
        return scheduler.expected_seconds(prompt_tokens, output_tokens) if scheduler is not None else None

    def stats(self) -> dict[str, Any]:
        """Queue depth, active sequences, KV cells, token rates and TTFT, for telemetry."""
        load = self._scheduler.load() if self._scheduler is not None else {}
        return {"model": self.model_name, "available": self.available, **load, **self._stats.snapshot()}

    def _loaded(self) -> LlamaModel:
        if self._model is None:
            raise EngineBusy("the edge engine is not started", retry_after=5)
        return self._model
