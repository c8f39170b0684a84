"""Each coding agent once more, against the real llama.cpp upstream (llama-cpp-python's server).

Any answer will do (the bundled SmolLM2-135M is no coding model); what must hold is that neither
the gateway nor the upstream refuses or fails a request: the translation sends what a
self-hosted chat template renders (plain-string contents, tool results as strings, no null
content), and the upstream's `max_output_tokens` keeps the agents' 128,000-token asks inside its
context.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_agents import ALIASES, ledger_rows
from tests.support import agents
from tests.support.config import upstream_cfg
from tests.support.llama_server import UPSTREAM_MODEL, LlamaServer

pytestmark = [pytest.mark.agents, pytest.mark.slow]

# SmolLM2's trained context: Codex's default prompt is ~6,200 tokens, Claude Code's ~4,300.
N_CTX = 8192
MAX_OUTPUT = 48


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    server = LlamaServer(tmp_path_factory.mktemp("llama-agents") / "server.log", n_ctx=N_CTX)
    yield server
    server.stop()


@pytest.mark.parametrize("agent, api", [(agents.CLAUDE, "messages"), (agents.CODEX, "responses")], ids=["claude", "codex"])
def test_the_agent_runs_against_llama_cpp_with_no_error(make_gateway, long_llama, tmp_path: Path, agent: Any, api: str):
    gw = make_gateway(upstreams=[upstream_cfg("llama", long_llama.base_url, models=[UPSTREAM_MODEL], read_timeout_s=300,
                                              max_output_tokens=MAX_OUTPUT)], model_aliases=ALIASES)
    work = tmp_path / "work"
    work.mkdir()
    out = agents.run(agent, gw.url, work, tmp_path / "home", "Say hi.", timeout=300)
    said = out.stdout + out.stderr
    # The model samples (neither agent asks for greedy decoding): an answer cut at MAX_OUTPUT is a
    # `max_tokens` stop / an incomplete response, which each agent reports as its own error; any
    # other failure is the test's.
    truncated = ("output token maximum" in said  # Claude Code
                 or "Incomplete response returned, reason: max_output_tokens" in said)  # Codex
    assert out.returncode == 0 or truncated, said[-4000:]
    assert "API Error: 4" not in said and "API Error: 5" not in said, said[-4000:]
    rows = ledger_rows(gw, tmp_path / "state")
    assert rows and [(r["status"], r["error_code"]) for r in rows] == [(200, None)] * len(rows)
    # the clamp held (a sampled answer may also be empty); where the server reported no usage the
    # gateway's estimate counts with another tokenizer, so it may pass the limit by a little
    assert {r["api"] for r in rows} == {api}
    assert all(r["output_tokens"] <= (2 * MAX_OUTPUT if r["estimated"] else MAX_OUTPUT) for r in rows), \
        [(r["output_tokens"], r["estimated"]) for r in rows]
    if out.returncode == 0:
        assert out.stdout.strip()  # some answer
    log = Path(long_llama.log.name).read_text(errors="replace")
    statuses = [int(code) for code in re.findall(r'"POST /v1/chat/completions HTTP/1.1" (\d{3})', log)]
    assert len(statuses) >= len(rows) and set(statuses) == {200}, statuses  # the upstream's own access log
    assert "Traceback" not in log
