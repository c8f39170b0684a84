"""The cascade policy section: strict at load, overrides per tenant/app, thresholds from targets."""

from __future__ import annotations

import pytest

from policies.cascade import CascadePolicy, CascadePolicyError
from policies.policy import Policy


def policy(**cascade: object) -> CascadePolicy:
    return CascadePolicy(Policy.load(extra={"cascade": cascade}))


def test_shipped_rules_and_overrides() -> None:
    p = policy(overrides=[{"match": {"tenant": "bank"}, "set": {"target": {"mode": "min_local_accuracy", "value": 0.97}}},
                          {"match": {"tenant": "lab", "app": "x"}, "set": {"enabled": False}},
                          {"match": {"tenant": "lab"}, "set": {"learn": {"enabled": False}}}])
    assert p.rules("t", "a").target.value == 0.90
    assert p.rules("t", "a").learn.enabled is True and p.rules("lab", "y").learn.enabled is False  # learning: on, off per tenant
    assert p.rules("bank", "a").target.value == 0.97
    assert p.rules("bank", "a").prior == p.rules("t", "a").prior
    assert p.rules("lab", "x").enabled is False and p.rules("lab", "y").enabled is True


@pytest.mark.parametrize(("section", "where"), [
    ({"hold_tokens": -1}, "cascade.hold_tokens"),
    ({"target": {"mode": "most_accurate", "value": 0.9}}, "cascade.target.mode"),
    ({"target": {"mode": "threshold", "value": 1.5}}, "cascade.target.value"),
    ({"holdtokens": 3}, "cascade.holdtokens"),
    ({"overrides": [{"match": {"model": "x"}, "set": {}}]}, "cascade.overrides[0].match.model"),
    ({"overrides": [{"match": {"tenant": "t"}, "set": {"hold_tokens": "8"}}]}, "cascade.overrides[0].set.hold_tokens"),
])
def test_a_bad_section_fails_at_load_naming_the_key(section: dict[str, object], where: str) -> None:
    with pytest.raises(CascadePolicyError) as info:
        policy(**section)
    assert where in str(info.value)
