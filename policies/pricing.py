"""Prices of the lanes (upstream models and pools, the edge lane, cache hits) from the `pricing` policy section.

A price is any combination of the ways upstreams bill: per token (input, output, cached input;
per million tokens, or per 1k with the `_per_1k` keys), per request, and per second of upstream
time (`per_second`: GPU-seconds of a dedicated deployment, read as the lane seconds the request
spent waiting on it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from policies.domain import Priority, Usage
from policies.policy import Policy

PER_MILLION = 1_000_000.0


@dataclass(slots=True, frozen=True)
class TokenPrice:
    """USD per million tokens (input, output, input read from the provider's prompt cache), per
    request, and per second of upstream time.

    `tokens_per_second`: the output throughput used to estimate the seconds an answer would have
    taken on this upstream when it did not serve it (a counterfactual); None: such answers are
    priced without a time component.
    """

    input: float
    output: float
    cached_input: float
    per_request: float = 0.0
    per_second: float = 0.0
    tokens_per_second: float | None = None
    # input written to the prompt cache, for 5 minutes and for an hour (Anthropic: 1.25x and 2x input)
    cache_write: float = 0.0
    cache_write_1h: float = 0.0

    def charge(self, usage: Usage, seconds: float, *, cache_discount: bool = True) -> float:
        """The whole bill of one request: its tokens, the request itself and `seconds` of upstream time."""
        return self.cost(usage, cache_discount=cache_discount) + self.per_request + self.per_second * max(0.0, seconds)

    def estimated_seconds(self, usage: Usage) -> float:
        """Upstream seconds an answer of `usage` would take here (0 without a stated throughput)."""
        if not self.per_second or not self.tokens_per_second:
            return 0.0
        return usage.output_tokens / self.tokens_per_second

    def cost(self, usage: Usage, *, cache_discount: bool = True) -> float:
        """What these tokens cost: cache reads at `cached_input`, cache writes at their own prices, the
        rest of the input at `input`; `cache_discount=False` prices all input as plain input."""
        if not cache_discount:
            return (usage.input_tokens * self.input + usage.output_tokens * self.output) / PER_MILLION
        cached = min(max(0, usage.cached_input_tokens), usage.input_tokens)
        written = min(max(0, usage.cache_write_tokens), usage.input_tokens - cached)
        written_1h = min(max(0, usage.cache_write_1h_tokens), usage.input_tokens - cached - written)
        return (
            (usage.input_tokens - cached - written - written_1h) * self.input
            + cached * self.cached_input
            + written * self.cache_write
            + written_1h * self.cache_write_1h
            + usage.output_tokens * self.output
        ) / PER_MILLION

    def input_cost(self, tokens: int) -> float:
        return tokens * self.input / PER_MILLION

    def scaled(self, factor: float) -> TokenPrice:
        """Every price times `factor` (the throughput stays): a discounted tariff."""
        return replace(self, input=self.input * factor, output=self.output * factor, cached_input=self.cached_input * factor,
                       per_request=self.per_request * factor, per_second=self.per_second * factor,
                       cache_write=self.cache_write * factor, cache_write_1h=self.cache_write_1h * factor)


@dataclass(slots=True, frozen=True)
class Pricing:
    """Every price the metering needs; built once from the policy."""

    models: dict[str, TokenPrice]
    default_upstream_model: str
    unknown_model: TokenPrice
    edge: TokenPrice
    cache_per_request: float = 0.0
    known: frozenset[str] = field(default_factory=frozenset)
    pools: dict[str, TokenPrice] = field(default_factory=dict)  # a priced pool bills whatever model it serves
    # the share taken off every upstream price for batch-priority requests (Batch API lines)
    batch_discount: float = 0.0
    batch: Pricing | None = field(default=None, compare=False, repr=False)  # these prices with the discount taken off

    @classmethod
    def from_policy(cls, policy: Policy) -> Pricing:
        return cls.from_section(policy.section("pricing"))

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> Pricing:
        discount = _number(section.get("cached_input_discount", 0.0), "cached_input_discount")
        if not 0.0 <= discount <= 1.0:
            raise ValueError("pricing.cached_input_discount must lie between 0 and 1")
        models = {
            str(name): _price(entry, discount, f"models.{name}")
            for name, entry in (section.get("models") or {}).items()
        }
        default = str(section.get("default_upstream_model") or "")
        if default not in models:
            raise ValueError(
                f"pricing.default_upstream_model {default!r} has no entry under pricing.models"
            )
        unknown_entry = section.get("unknown_model")
        unknown = models[default] if unknown_entry is None else _price(unknown_entry, discount, "unknown_model")
        edge = _price(section.get("edge") or {"input": 0, "output": 0}, discount, "edge")
        pools = {
            str(name): _price(entry, discount, f"pools.{name}")
            for name, entry in (section.get("pools") or {}).items()
        }
        batch_discount = _number(section.get("batch_discount", 0.0), "batch_discount")
        if batch_discount > 1.0:
            raise ValueError("pricing.batch_discount must lie between 0 and 1")
        full = cls(
            models=models,
            default_upstream_model=default,
            unknown_model=unknown,
            edge=edge,
            cache_per_request=_number(section.get("cache_per_request", 0.0), "cache_per_request"),
            known=frozenset(models),
            pools=pools,
            batch_discount=batch_discount,
        )
        return replace(full, batch=full._discounted(1.0 - batch_discount)) if batch_discount else full

    def _discounted(self, factor: float) -> Pricing:
        """The upstream prices (models, pools, unknown_model) times `factor`; the edge and cache hits as they are.

        NOTE: one scaled price per original, so the prices that are one object here (unknown_model
        and the default model's) stay one object: the bill compares prices by identity.
        """
        scaled: dict[int, TokenPrice] = {}

        def scale(price: TokenPrice) -> TokenPrice:
            return scaled.setdefault(id(price), price.scaled(factor))

        return replace(self, models={name: scale(p) for name, p in self.models.items()}, unknown_model=scale(self.unknown_model),
                       pools={name: scale(p) for name, p in self.pools.items()}, batch=None)

    def for_priority(self, priority: Priority) -> Pricing:
        """The prices a request of `priority` pays: batch work gets `batch_discount` off the upstream prices."""
        return self.batch if priority == "batch" and self.batch is not None else self

    def upstream(self, model: str | None, pool: str | None = None) -> TokenPrice:
        """The price of an upstream model on a pool: the pool's where it is priced, else the model's;
        unlisted models get `unknown_model`."""
        if pool is not None and pool in self.pools:
            return self.pools[pool]
        if model is None:
            return self.models[self.default_upstream_model]
        return self.models.get(model, self.unknown_model)

    def counterfactual_model(self, requested: str | None) -> str:
        """The upstream model a request would have gone to without the cache and the edge lane."""
        if requested is not None and requested in self.known:
            return requested
        return self.default_upstream_model


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"pricing.{where} must be a number, got {value!r}")
    if value < 0:
        raise ValueError(f"pricing.{where} must not be negative")
    return float(value)


PRICE_KEYS = frozenset({
    "input", "output", "cached_input", "input_per_1k", "output_per_1k", "cached_input_per_1k",
    "cache_write", "cache_write_per_1k", "cache_write_1h", "cache_write_1h_per_1k",
    "per_request", "per_second", "tokens_per_second",
})  # fmt: skip
# Prompt-cache writes without a price of their own: input x these (Anthropic's published premiums).
CACHE_WRITE_5M = 1.25
CACHE_WRITE_1H = 2.0


def _per_million(entry: Mapping[str, Any], key: str, where: str) -> float | None:
    """`key` per million tokens, or `key_per_1k` x 1000; None when neither is given; not both."""
    plain, per_1k = entry.get(key), entry.get(f"{key}_per_1k")
    if plain is not None and per_1k is not None:
        raise ValueError(f"pricing.{where} gives both {key} and {key}_per_1k; give one")
    if per_1k is not None:
        return _number(per_1k, f"{where}.{key}_per_1k") * 1000.0
    return None if plain is None else _number(plain, f"{where}.{key}")


def _price(entry: Any, discount: float, where: str) -> TokenPrice:
    if not isinstance(entry, Mapping):
        raise ValueError(f"pricing.{where} must be a mapping of prices (input, output, per_request, per_second)")
    unknown = set(entry) - PRICE_KEYS
    if unknown:
        raise ValueError(f"pricing.{where} has unknown key(s) {sorted(unknown)}; keys are {', '.join(sorted(PRICE_KEYS))}")
    input_price = _per_million(entry, "input", where)
    output_price = _per_million(entry, "output", where)
    per_request, per_second = entry.get("per_request"), entry.get("per_second")
    if input_price is None and output_price is None and per_request is None and per_second is None:
        raise ValueError(f"pricing.{where} names no price: give input/output, per_request or per_second")
    if (input_price is None) != (output_price is None):  # token prices come in pairs
        missing = "input" if input_price is None else "output"
        raise ValueError(f"pricing.{where}.{missing} must be a number, got None (token prices come as input and output)")
    cached = _per_million(entry, "cached_input", where)
    write = _per_million(entry, "cache_write", where)
    write_1h = _per_million(entry, "cache_write_1h", where)
    base = input_price or 0.0
    throughput = entry.get("tokens_per_second")
    if throughput is not None and _number(throughput, f"{where}.tokens_per_second") <= 0:
        raise ValueError(f"pricing.{where}.tokens_per_second must be positive")
    return TokenPrice(
        input=base,
        output=output_price or 0.0,
        cached_input=base * (1.0 - discount) if cached is None else cached,
        per_request=0.0 if per_request is None else _number(per_request, f"{where}.per_request"),
        per_second=0.0 if per_second is None else _number(per_second, f"{where}.per_second"),
        tokens_per_second=None if throughput is None else float(throughput),
        cache_write=base * CACHE_WRITE_5M if write is None else write,
        cache_write_1h=base * CACHE_WRITE_1H if write_1h is None else write_1h,
    )
