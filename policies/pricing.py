"""Prices of the lanes (upstream models, the edge lane, cache hits) from the `pricing` policy section."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from policies.domain import Usage
from policies.policy import Policy

PER_MILLION = 1_000_000.0


@dataclass(slots=True, frozen=True)
class TokenPrice:
    """USD per million tokens: input, output, and input read from the provider's prompt cache."""

    input: float
    output: float
    cached_input: float

    def cost(self, usage: Usage, *, cache_discount: bool = True) -> float:
        """What these tokens cost; `cache_discount=False` prices cached input as plain input."""
        cached = min(usage.cached_input_tokens, usage.input_tokens) if cache_discount else 0
        return (
            (usage.input_tokens - cached) * self.input
            + cached * self.cached_input
            + usage.output_tokens * self.output
        ) / PER_MILLION

    def input_cost(self, tokens: int) -> float:
        return tokens * self.input / PER_MILLION


@dataclass(slots=True, frozen=True)
class Pricing:
    """Every price the metering needs; built once from the policy."""

    models: dict[str, TokenPrice]
    default_upstream_model: str
    unknown_model: TokenPrice
    edge: TokenPrice
    cache_per_request: float = 0.0
    known: frozenset[str] = field(default_factory=frozenset)

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
        return cls(
            models=models,
            default_upstream_model=default,
            unknown_model=unknown,
            edge=edge,
            cache_per_request=_number(section.get("cache_per_request", 0.0), "cache_per_request"),
            known=frozenset(models),
        )

    def upstream(self, model: str | None) -> TokenPrice:
        """The price of an upstream model; unlisted models get `unknown_model`."""
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


def _price(entry: Any, discount: float, where: str) -> TokenPrice:
    if not isinstance(entry, Mapping):
        raise ValueError(f"pricing.{where} must be a mapping with input and output prices")
    input_price = _number(entry.get("input"), f"{where}.input")
    cached = entry.get("cached_input")
    return TokenPrice(
        input=input_price,
        output=_number(entry.get("output"), f"{where}.output"),
        cached_input=input_price * (1.0 - discount) if cached is None else _number(cached, f"{where}.cached_input"),
    )
