"""The learned-template stage: an adapter that fails on a serving template sends the request upstream, never an error."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from edge_engine.adapters import AdapterLimits, AdapterRunner
from gateway.context import RequestContext
from gateway.pipeline.learned import LearnedStage
from gateway.protocol import validate
from policies.artifact_dir import sha256_file
from policies.domain import Principal
from policies.learn.config import LearnPolicy
from policies.learn.pairs import FILENAME, PairStore
from policies.learn.service import Learning
from policies.learn.serving import LearnedServing
from policies.policy import Policy
from policies.trim.tokenizer import bundled_edge_model

pytest.importorskip("gguf", reason="the learn extra writes adapters (make install installs it)")

from tests.support.learned import write_learned

SYSTEM = "Say whether the review is positive or negative."


@pytest.mark.slow
def test_a_damaged_adapter_on_a_serving_template_sends_the_request_upstream(tmp_path: Path) -> None:
    policy = LearnPolicy(Policy.load(extra={"learn": {"templates": {"sent": {"prefix": SYSTEM}}}}))
    version = policy.for_app("t", "a").templates.by_name["sent"].version
    manifest = write_learned(tmp_path / "learn", tenant="t", app="a", template="sent", version=version,
                             labels=["positive", "negative"])  # fmt: skip
    manifest.with_suffix(".gguf").write_bytes(b"not a gguf file")  # damaged after it was written
    runner = AdapterRunner(bundled_edge_model(), AdapterLimits(n_ctx=512, n_threads=1))
    body = {"model": "m", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "I loved it"}]}
    ctx = RequestContext(request_id="r", operation="chat", body=body, headers={}, principal=Principal(tenant="t", app="a"),
                         model="m")  # fmt: skip
    ctx.request = validate("chat", body, max_n=1)

    async def scenario() -> object:
        serving = LearnedServing(policy, tmp_path / "learn", runner, sha256_file(bundled_edge_model()))
        await serving.refresh()
        choice = serving.choice("t", "a", "sent", version)
        assert choice is not None
        for _ in range(200):
            choice.gate.observe(wrong=False)
        assert choice.gate.serves
        stage = LearnedStage(Learning(policy, PairStore(tmp_path / FILENAME)), serving)
        answer = await stage.run(ctx)
        assert stage.counts == {"failed": 1}
        await serving.close()
        return answer

    assert asyncio.run(scenario()) is None  # no local answer: the request goes on to the upstream
    assert ctx.lane == "upstream" and ctx.attributes["tierlane.learn.decision"] == "failed"
