"""Collection of learned templates through a real gateway and fault upstreams: only the tenant/app
that opted in, only whole answers, visible at GET /v1/edge/templates and on /metrics, forgotten by DELETE."""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from gateway.auth import hash_key
from gateway.keys import PIPELINE, SERVICES
from policies.learn.pairs import FILENAME, PairReader
from tests.support.background import BackgroundLoop, RunningApp
from tests.support.config import upstream_cfg
from tests.support.faults import Recorder, completion, fault_app

SUPPORT, OTHER_APP, ADMIN, OTHER_ADMIN = "tl-learn-support", "tl-learn-other", "tl-learn-admin", "tl-learn-zeta-admin"
TICKET = "Classify this support ticket as billing, bug or other."


def cut(reason: str, **message: Any) -> dict[str, Any]:
    body = completion("The ticket is about")
    body["choices"][0]["finish_reason"] = reason
    body["choices"][0]["message"].update(message)
    return body


def start(bg: BackgroundLoop, make_gateway: Any, **extra: Any) -> Any:
    ok = RunningApp(bg, fault_app("ok", Recorder(), text="billing"))
    length = RunningApp(bg, fault_app("body", Recorder(), body=cut("length")))
    tools = RunningApp(bg, fault_app("body", Recorder(), body=cut(
        "tool_calls", content=None, tool_calls=[{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}])))
    keys = [{"sha256": hash_key(SUPPORT), "tenant": "acme", "app": "support"},
            {"sha256": hash_key(OTHER_APP), "tenant": "acme", "app": "other"},
            {"sha256": hash_key(ADMIN), "tenant": "ops", "admin": True},
            {"sha256": hash_key(OTHER_ADMIN), "tenant": "zeta", "admin": True, "admin_scope": "tenant"}]  # fmt: skip
    learn = {"overrides": [{"match": {"tenant": "acme", "app": "support"},
                            "set": {"templates": {"ticket": {"prefix": TICKET}, "tagging": {}}}}]}  # fmt: skip
    return make_gateway(
        upstreams=[upstream_cfg("ok", ok.url + "/v1", models=["m"]),
                   upstream_cfg("length", length.url + "/v1", models=["m-cut"]),
                   upstream_cfg("tools", tools.url + "/v1", models=["m-tools"])],
        auth={"mode": "keys", "keys": keys}, policy={"learn": learn}, **extra,
    )  # fmt: skip


def ask(gw: Any, key: str, messages: list[dict[str, Any]], model: str = "m", stream: bool = False,
        template: str | None = None) -> httpx.Response:  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"} | ({"x-tierlane-template": template} if template else {})
    body = {"model": model, "messages": messages, "stream": stream}
    answer = httpx.post(gw.url + "/v1/chat/completions", content=orjson.dumps(body), headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer


def settle(bg: BackgroundLoop, gw: Any) -> None:
    bg.call(gw.app[PIPELINE].drain())
    learn = gw.app[SERVICES].learn
    assert learn is not None
    bg.call(learn.store.flush())


def ticket(text: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": TICKET}, {"role": "user", "content": text}]


def test_only_whole_upstream_answers_of_the_app_that_opted_in_are_kept(bg: BackgroundLoop, make_gateway: Any) -> None:
    gw = start(bg, make_gateway)
    ask(gw, SUPPORT, ticket("I was charged twice."))
    ask(gw, SUPPORT, ticket("The app crashes on start."), stream=True)  # assembled from the stream
    ask(gw, SUPPORT, [{"role": "user", "content": "tag: a red bike"}], template="tagging")
    ask(gw, OTHER_APP, ticket("not opted in"))  # same tenant, another app
    ask(gw, OTHER_APP, [{"role": "user", "content": "tag: x"}], template="tagging")  # the header of another app's template
    ask(gw, SUPPORT, [{"role": "user", "content": "tag: y"}], template="no-such-template")  # ignored, no 400
    ask(gw, SUPPORT, ticket("cut short"), model="m-cut")
    ask(gw, SUPPORT, ticket("calls a tool"), model="m-tools")
    settle(bg, gw)

    with PairReader(gw.app[SERVICES].settings.state_dir / FILENAME) as reader:
        assert {(t.tenant, t.app, t.template, t.pairs) for t in reader.templates()} == {
            ("acme", "support", "ticket", 2), ("acme", "support", "tagging", 1)}
        tickets = list(reader.pairs("acme", "support", "ticket"))
        assert [p.variable for p in tickets] == ["The app crashes on start.", "I was charged twice."]  # newest first
        assert all(p.answer.strip() == "billing" and p.matched_by == "prefix" for p in tickets)
        plain = tickets[1]
        assert (plain.messages, plain.model, plain.input_tokens) == (ticket("I was charged twice."), "m", 7)
        tagged = list(reader.pairs("acme", "support", "tagging"))
        assert [(p.matched_by, p.variable) for p in tagged] == [("header", None)]

    learn = gw.app[SERVICES].learn
    assert learn is not None
    stats = {s.template: s for s in learn.stats()}
    assert stats["ticket"].collected == 2 and stats["ticket"].skipped == {"length": 1, "tool_calls": 1}


def test_templates_are_listed_for_admins_and_forgotten_by_delete(bg: BackgroundLoop, make_gateway: Any) -> None:
    gw = start(bg, make_gateway, telemetry={"tracing": False, "metrics": True, "tenants": ["acme"], "apps": ["support"]})
    ask(gw, SUPPORT, ticket("I was charged twice."))
    ask(gw, SUPPORT, ticket("cut short"), model="m-cut")
    settle(bg, gw)
    admin = {"Authorization": f"Bearer {ADMIN}"}

    listed = httpx.get(gw.url + "/v1/edge/templates", headers=admin, timeout=30).json()["data"]
    by_name = {row["template"]: row for row in listed if row["tenant"] == "acme"}
    assert by_name["ticket"]["state"] == "collecting" and by_name["ticket"]["pairs"] == 1
    assert by_name["tagging"]["state"] == "collecting" and by_name["tagging"]["pairs"] == 0
    assert httpx.get(gw.url + "/v1/edge/templates", headers={"Authorization": f"Bearer {SUPPORT}"}, timeout=30).status_code == 403
    zeta = {"Authorization": f"Bearer {OTHER_ADMIN}"}
    assert httpx.get(gw.url + "/v1/edge/templates", headers=zeta, timeout=30).json()["data"] == []  # its own tenant only
    assert httpx.get(gw.url + "/v1/edge/templates?tenant=acme", headers=zeta, timeout=30).status_code == 403
    assert httpx.delete(gw.url + "/v1/edge/templates/ticket?tenant=acme", headers=zeta, timeout=30).status_code == 403
    assert httpx.delete(gw.url + "/v1/edge/templates/ticket", headers=zeta, timeout=30).status_code == 403  # every tenant

    metrics = httpx.get(gw.url + "/metrics", headers=admin, timeout=30).text
    labels = 'app="support",template="ticket",tenant="acme"'  # in name order, as the exposition writes them
    assert f"tierlane_learn_pairs_collected_total{{{labels}}} 1.0" in metrics
    assert 'tierlane_learn_pairs_skipped_total{app="support",reason="length",template="ticket",tenant="acme"} 1.0' in metrics
    assert f"tierlane_learn_pairs{{{labels}}} 1.0" in metrics

    forgot = httpx.delete(gw.url + "/v1/edge/templates/ticket?tenant=acme&app=support", headers=admin, timeout=30).json()
    assert forgot["deleted"] == 1
    listed = httpx.get(gw.url + "/v1/edge/templates?tenant=acme", headers=admin, timeout=30).json()["data"]
    assert {row["template"]: row["pairs"] for row in listed} == {"ticket": 0, "tagging": 0}
    bad = httpx.delete(gw.url + "/v1/edge/templates/bad%20name?tenant=acme", headers=admin, timeout=30)
    assert bad.status_code == 400


def test_a_gateway_whose_policy_names_no_template_keeps_nothing(bg: BackgroundLoop, make_gateway: Any) -> None:
    ok = RunningApp(bg, fault_app("ok", Recorder(), text="billing"))
    gw = make_gateway(upstreams=[upstream_cfg("ok", ok.url + "/v1", models=["m"])])
    assert gw.app[SERVICES].learn is None
    answer = httpx.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": ticket("x")},
                        headers={"x-tierlane-template": "ticket"}, timeout=30)  # fmt: skip
    assert answer.status_code == 200
    bg.call(gw.app[PIPELINE].drain())
    assert not (gw.app[SERVICES].settings.state_dir / FILENAME).exists()
    assert httpx.get(gw.url + "/v1/edge/templates", timeout=30).json()["data"] == []  # open mode: an admin
