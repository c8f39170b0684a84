"""Policy sections are parsed by models that forbid unknown keys: a typo fails at start-up, by its path."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from gateway.components import COMPONENTS
from gateway.settings import Settings
from policies.cache.config import CacheConfig, CachePolicyError
from policies.policy import Policy
from policies.trim import TrimPolicy, TrimPolicyError


def _policy(text: str) -> Policy:
    return Policy.load(extra=yaml.safe_load(text))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("cache: {verify: {numbres: false}}", "cache.verify.numbres: extra fields not permitted"),
        ("cache: {treshold: 0.9}", "cache.treshold: extra fields not permitted"),
        ("cache: {threshold: 1.5}", "cache.threshold: "),
        ("cache: {enabled: 'yes'}", "cache.enabled: "),
        ("cache: {operations: [chats]}", r"cache.operations\[0\]: "),
        ("cache: {verify: {negation_words: [not, no]}}", "cache.verify.negation_words: must be a list of quoted words"),
        (
            "cache: {overrides: [{match: {tenant: acme}, set: {verify: {numbres: false}}}]}",
            r"cache.overrides\[0\].set.verify.numbres: extra fields not permitted",
        ),
        ("cache: {overrides: [{match: {tenant: a}}, {match: {tenent: b}}]}", r"cache.overrides\[1\].match.tenent: "),
        ("cache: {overrides: [{match: {app: x}, sett: {}}]}", r"cache.overrides\[0\].sett: extra fields not permitted"),
        ("cache: {overrides: [{match: {app: x}, set: {candidates: 0}}]}", r"cache.overrides\[0\].set.candidates: "),
    ],
)
def test_a_bad_cache_section_names_the_key_at_fault(text: str, message: str) -> None:
    with pytest.raises(CachePolicyError, match=message):
        CacheConfig.from_section(_policy(text).section("cache"))


def test_a_bad_cache_override_stops_the_gateway_at_start_up_even_with_the_cache_off() -> None:
    cache = next(c for c in COMPONENTS if c.attribute == "cache")
    settings = Settings.load(env={})
    assert cache.enabled(settings, Policy.load()) is True
    assert cache.enabled(settings, _policy("cache: {enabled: false}")) is False
    bad = _policy("cache: {enabled: false, overrides: [{match: {app: x}, set: {ttl: 60}}]}")
    with pytest.raises(CachePolicyError, match=r"cache.overrides\[0\].set.ttl: extra fields not permitted"):
        cache.enabled(settings, bad)


def test_a_resolved_cache_override_is_applied() -> None:
    policy = _policy("cache: {overrides: [{match: {tenant: acme}, set: {threshold: 0.9, verify: {numbers: false}}}]}")
    acme = CacheConfig.from_section(policy.resolve("cache", tenant="acme"))
    other = CacheConfig.from_section(policy.resolve("cache", tenant="other"))
    assert (acme.threshold, acme.verify.numbers, acme.verify.entities) == (0.9, False, True)
    assert (other.threshold, other.verify.numbers) == (0.80, True)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"histroy": {}}, "trim.histroy: extra fields not permitted"),
        ({"history": {"max_token": 10}}, "trim.history.max_token: extra fields not permitted"),
        ({"history": {"max_tokens": "lots"}}, "trim.history.max_tokens: "),
        ({"history": {"max_tokens": True}}, "trim.history.max_tokens: "),
        ({"whitespace": {"enabled": "yes"}}, "trim.whitespace.enabled: "),
        ({"tool_output": {"max_tokens": 100, "head_tokens": 60, "tail_tokens": 30}}, "trim.tool_output: head_tokens"),
        (
            {"overrides": [{"match": {"model": "m"}, "set": {"history": {"max_tokens": -1}}}]},
            r"trim.overrides\[0\].set.history.max_tokens: ",
        ),
        ({"overrides": [{"match": {"route": "edge"}, "set": {}}]}, r"trim.overrides\[0\].match.route: "),
    ],
)
def test_a_bad_trim_section_names_the_key_at_fault(section: dict[str, Any], message: str) -> None:
    with pytest.raises(TrimPolicyError, match=message):
        TrimPolicy.from_dict(section)


def test_a_sub_section_left_empty_in_yaml_takes_its_defaults() -> None:
    policy = TrimPolicy.from_dict(yaml.safe_load("pin:\n  # roles: [system]\nhistory:\n"))
    assert policy.pin_roles == frozenset() and policy.history_budget is None
