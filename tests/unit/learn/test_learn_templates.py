"""The learn section and the template matcher: opt-in per tenant/app, prefix, digest, header and app matches."""

from __future__ import annotations

from importlib import resources
from typing import Any

import pytest
import yaml

from policies.learn.config import LearnPolicy, LearnPolicyError, LearnSection, prefix_digest
from policies.policy import Policy

TICKET = "Classify this support ticket as billing, bug or other."
REVIEW = "Is the following review positive? Answer yes or no.\n"


def policy(templates: dict[str, Any], match: dict[str, Any] | None = None, **section: Any) -> LearnPolicy:
    rule = {"match": match or {"tenant": "acme", "app": "support"}, "set": {"templates": templates}}
    return LearnPolicy(Policy.load(extra={"learn": {**section, "overrides": [rule]}}))


def user(text: Any) -> dict[str, Any]:
    return {"role": "user", "content": text}


def system(text: str) -> dict[str, Any]:
    return {"role": "system", "content": text}


def test_the_shipped_section_names_no_template_and_lists_the_model_defaults() -> None:
    shipped = yaml.safe_load((resources.files("policies") / "defaults" / "learn.yaml").read_text("utf-8"))["learn"]
    assert shipped == LearnSection().model_dump() | {"overrides": []}
    learn = LearnPolicy(Policy.load())
    assert not learn.any_template
    assert not learn.for_app("default", "default").templates


def test_only_the_tenant_app_an_override_names_has_templates() -> None:
    learn = policy({"ticket": {"prefix": TICKET}})
    assert learn.any_template
    assert learn.named() == [("acme", "support")]
    assert set(learn.for_app("acme", "support").templates.by_name) == {"ticket"}
    for tenant, app in (("acme", "billing"), ("other", "support"), ("default", "default")):
        assert not learn.for_app(tenant, app).templates
        assert learn.for_app(tenant, app).templates.match([system(TICKET), user("x")], "ticket") is None


def test_an_override_switches_one_template_off_for_one_app() -> None:
    learn = LearnPolicy(Policy.load(extra={"learn": {
        "templates": {"ticket": {"prefix": TICKET}},  # every tenant/app: the operator's explicit choice
        "overrides": [{"match": {"tenant": "acme", "app": "quiet"}, "set": {"templates": {"ticket": {"enabled": False}}}}],
    }}))  # fmt: skip
    assert set(learn.for_app("acme", "support").templates.by_name) == {"ticket"}
    assert not learn.for_app("acme", "quiet").templates


def test_a_prefix_opens_the_system_prompt_or_the_first_user_message() -> None:
    templates = policy({"ticket": {"prefix": TICKET}}).for_app("acme", "support").templates
    by_system = templates.match([system(TICKET), user("My card was charged twice.")])
    assert by_system is not None and by_system.template.name == "ticket" and by_system.via == "prefix"
    assert by_system.variable == "My card was charged twice."
    by_user = templates.match([user(TICKET + "\nTicket: the app crashes")])
    assert by_user is not None and by_user.variable == "Ticket: the app crashes"
    # text parts are read as one text
    parts = [{"type": "text", "text": TICKET[:10]}, {"type": "text", "text": TICKET[10:] + " It crashes."}]
    found = templates.match([user(parts)])
    assert found is not None and found.variable == "It crashes."
    assert templates.match([user("Classify this ticket please")]) is None
    assert templates.match([system("You are helpful."), user("hello " + TICKET)]) is None  # a prefix, not a substring


def test_the_longest_prefix_wins() -> None:
    templates = policy({"short": {"prefix": "Classify"}, "long": {"prefix": TICKET}}).for_app("acme", "support").templates
    found = templates.match([user(TICKET + " x")])
    assert found is not None and found.template.name == "long"
    found = templates.match([user("Classify the colour: red")])
    assert found is not None and found.template.name == "short"


def test_a_digest_names_the_prefix_without_its_text() -> None:
    digest, chars = prefix_digest(REVIEW)
    templates = policy({"review": {"prefix_sha256": digest, "prefix_chars": chars}}).for_app("acme", "support").templates
    found = templates.match([user(REVIEW + "Great phone, poor battery.")])
    assert found is not None and found.template.name == "review" and found.variable == "Great phone, poor battery."
    assert templates.match([user(REVIEW.upper() + "Great phone")]) is None
    assert templates.match([user("short")]) is None


def test_the_header_names_an_enabled_template_and_any_other_name_is_ignored() -> None:
    templates = policy({"tagging": {}, "ticket": {"prefix": TICKET}}).for_app("acme", "support").templates
    found = templates.match([user("tag this: a red bike")], "tagging")
    assert found is not None and found.template.name == "tagging" and found.via == "header" and found.variable is None
    assert templates.match([user("tag this: a red bike")], "unknown") is None
    assert templates.match([user("tag this: a red bike")]) is None  # header-only: no header, no match
    # an unknown header is ignored, not an error: the prefix still decides
    found = templates.match([system(TICKET), user("x")], "unknown")
    assert found is not None and found.template.name == "ticket" and found.via == "prefix"
    # the header's template, with its variable part where its prefix is found
    found = templates.match([system(TICKET), user("x")], "ticket")
    assert found is not None and found.via == "header" and found.variable == "x"


def test_all_requests_matches_what_no_prefix_did() -> None:
    templates = policy({"whole": {"all_requests": True}, "ticket": {"prefix": TICKET}}).for_app("acme", "support").templates
    found = templates.match([user("anything")])
    assert found is not None and found.template.name == "whole" and found.via == "app"
    found = templates.match([user(TICKET)])
    assert found is not None and found.template.name == "ticket"


def test_bounds_of_a_template_default_to_the_section_and_its_definition_is_versioned() -> None:
    learn = policy({"a": {"prefix": "A:"}, "b": {"prefix": "B:", "max_pairs": 10, "retention_days": 2}}, max_pairs=100)
    by_name = learn.for_app("acme", "support").templates.by_name
    assert (by_name["a"].max_pairs, by_name["a"].retention_s) == (100, 30 * 86400.0)
    assert (by_name["b"].max_pairs, by_name["b"].retention_s) == (10, 2 * 86400.0)
    assert policy({"a": {"prefix": "A:"}}).for_app("acme", "support").templates.by_name["a"].version == by_name["a"].version
    assert policy({"a": {"prefix": "A!"}}).for_app("acme", "support").templates.by_name["a"].version != by_name["a"].version


def test_the_quota_is_the_tenants_whatever_the_app() -> None:
    learn = LearnPolicy(Policy.load(extra={"learn": {"overrides": [
        {"match": {"tenant": "acme"}, "set": {"tenant_quota_bytes": 1000}},
        {"match": {"tenant": "acme", "app": "support"}, "set": {"tenant_quota_bytes": 5, "templates": {"t": {}}}},
    ]}}))  # fmt: skip
    assert learn.tenant_quota("acme") == 1000
    assert learn.for_app("acme", "support").tenant_quota_bytes == 1000
    assert learn.tenant_quota("other") == 268_435_456


@pytest.mark.parametrize(("section", "message"), [
    ({"max_pairz": 3}, "learn.max_pairz: extra fields not permitted"),
    ({"templates": {"bad name": {}}}, "template name 'bad name'"),
    ({"templates": {"t": {"prefix": "x", "prefix_sha256": "0" * 64, "prefix_chars": 1}}}, "prefix or prefix_sha256"),
    ({"templates": {"t": {"prefix_sha256": "0" * 64}}}, "go together"),
    ({"templates": {"t": {"prefix_sha256": "XYZ", "prefix_chars": 3}}}, "64 lowercase hex"),
    ({"templates": {"t": {"prefixx": "x"}}}, "learn.templates.t.prefixx: extra fields not permitted"),
    ({"overrides": [{"match": {"tenant": "a"}, "set": {"templates": {"t": {"max_pairs": 0}}}}]},
     "learn.overrides[0].set.templates.t.max_pairs"),
    ({"overrides": [{"match": {"model": "a"}, "set": {}}]}, "learn.overrides[0].match.model"),
])  # fmt: skip
def test_a_malformed_section_fails_at_start_naming_the_key(section: dict[str, Any], message: str) -> None:
    with pytest.raises(LearnPolicyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        LearnPolicy(Policy.load(extra={"learn": section}))
