"""What the engine raises: its own errors, mapped to HTTP by the gateway's edge lane in one place."""

from __future__ import annotations


class EngineError(Exception):
    """A request the engine could not serve. `param` names the request field at fault, if one is."""

    code: str | None = None  # a stable machine-readable reason, where the class alone does not say it

    def __init__(
        self, message: str, *, param: str | None = None, retry_after: float | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after
        if code is not None:
            self.code = code


class InvalidInput(EngineError):
    """The request itself is wrong for this model (bad token ids, template refused the messages)."""


class GrammarTooComplex(InvalidInput):
    """A JSON-mode schema or grammar past the engine's bounds (edge.grammar): too costly to run here."""

    code = "grammar_too_complex"


class ContextTooLong(InvalidInput):
    """Prompt and completion do not fit the context window."""


class EngineBusy(EngineError):
    """No room now (queue full, KV cells taken) or the engine is starting, stopping or restarting."""


class EngineFailure(EngineError):
    """A step failed inside llama.cpp or the scheduler; the sequences in it were failed, the engine went on."""
