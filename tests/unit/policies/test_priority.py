"""The priority section: a request's class from its header, the tenant/app's default and max."""

from __future__ import annotations

from importlib import resources
from typing import Any

import pytest
import yaml

from policies.errors import InvalidInput
from policies.policy import Policy
from policies.priority import PriorityPolicy, PriorityPolicyError, PrioritySection

OVERRIDES = [
    {"match": {"tenant": "reports"}, "set": {"default": "batch", "max": "standard"}},
    {"match": {"tenant": "acme", "app": "nightly"}, "set": {"max": "standard"}},
]


def policy(**section: Any) -> PriorityPolicy:
    return PriorityPolicy(Policy.load(extra={"priority": section}))


def test_the_shipped_policy_makes_every_request_interactive_and_lets_it_ask_for_less() -> None:
    p = policy()
    assert p.resolve("t", "a", None, "interactive") == "interactive"
    assert p.resolve("t", "a", "standard", "interactive") == "standard"
    assert p.resolve("t", "a", " Batch ", "interactive") == "batch"


def test_the_header_is_bounded_by_the_tenant_max_and_the_default_too() -> None:
    p = policy(overrides=OVERRIDES)
    assert p.resolve("reports", "x", "interactive", "interactive") == "standard"
    assert p.resolve("reports", "x", None, "interactive") == "batch"
    assert p.resolve("acme", "nightly", None, "interactive") == "standard"  # a max alone lowers the default with it
    assert p.resolve("acme", "web", "interactive", "interactive") == "interactive"


def test_a_class_set_before_the_pipeline_is_never_raised() -> None:
    p = policy()
    assert p.resolve("t", "a", "interactive", "batch") == "batch"  # a Batch API line asking for more
    assert p.resolve("t", "a", None, "standard") == "standard"


def test_an_unknown_class_in_the_header_is_refused_naming_it() -> None:
    with pytest.raises(InvalidInput) as info:
        policy().resolve("t", "a", "urgent", "interactive")
    assert info.value.param == "x-tierlane-priority" and info.value.code == "invalid_priority"
    assert "interactive, standard, batch" in info.value.message


def test_a_bad_section_fails_at_load_naming_the_key() -> None:
    with pytest.raises(PriorityPolicyError, match=r"priority\.max"):
        policy(max="urgent")
    with pytest.raises(PriorityPolicyError, match=r"priority\.overrides\[0\]\.set\.default"):
        policy(overrides=[{"match": {"tenant": "x"}, "set": {"default": "later"}}])
    with pytest.raises(PriorityPolicyError, match=r"priority\.overrides\[0\]\.match\.model"):
        policy(overrides=[{"match": {"model": "x"}, "set": {"max": "batch"}}])


def test_the_shipped_file_lists_the_model_defaults() -> None:
    shipped = yaml.safe_load((resources.files("policies") / "defaults" / "priority.yaml").read_text("utf-8"))["priority"]
    assert set(shipped) == set(PrioritySection.model_fields)
    assert PrioritySection.model_validate(shipped) == PrioritySection()
