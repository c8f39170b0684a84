"""The real coding agents, installed from the npm registry at pinned versions into a cache dir.

`python -m tests.support.agents install` (run by `make test` before the suite) installs each
agent once into `~/.cache/tierlane/agents/<package>@<version>` (TIERLANE_AGENT_CACHE moves it);
nothing is installed globally. The tests and `bench/agents.py` run them from there, each with a
home directory of its own, pointed at a gateway on loopback.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Agent:
    name: str
    package: str
    version: str
    binary: str

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}"


CLAUDE = Agent("claude", "@anthropic-ai/claude-code", "2.1.328", "claude")
CODEX = Agent("codex", "@openai/codex", "0.169.0", "codex")
AGENTS = (CLAUDE, CODEX)


def cache_dir() -> Path:
    return Path(os.environ.get("TIERLANE_AGENT_CACHE") or Path.home() / ".cache" / "tierlane" / "agents")


def _prefix(agent: Agent) -> Path:
    return cache_dir() / agent.spec.replace("/", "+")


def binary(agent: Agent) -> Path:
    return _prefix(agent) / "node_modules" / ".bin" / agent.binary


def _works(agent: Agent) -> bool:
    path = binary(agent)
    if not path.exists():
        return False
    try:
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and agent.version in out.stdout


def install(agent: Agent) -> Path:
    """The agent's executable, installed first when the cache does not hold a working copy."""
    prefix = _prefix(agent)
    prefix.mkdir(parents=True, exist_ok=True)
    with open(prefix.parent / f".{prefix.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one installer per agent, whatever runs at once
        if _works(agent):
            return binary(agent)
        npm = shutil.which("npm")
        if npm is None:
            raise RuntimeError("npm is not installed: `make test` installs Debian's nodejs and npm; or install them")
        print(f"installing {agent.spec} into {prefix} ...", file=sys.stderr, flush=True)
        shutil.rmtree(prefix / "node_modules", ignore_errors=True)
        subprocess.run([npm, "install", "--prefix", str(prefix), "--no-save", "--no-audit", "--no-fund",
                        "--no-update-notifier", "--loglevel", "error", agent.spec], check=True, timeout=900)
        if not _works(agent):
            raise RuntimeError(f"{agent.spec} was installed into {prefix} but `{agent.binary} --version` fails")
    return binary(agent)


# The model names each agent sends with its defaults at the pinned version. Codex's default model
# sends its tools as `additional_tools` input items in namespaces, with a freeform JavaScript
# `exec` tool; `gpt-5.5` (CODEX_TOOLS_MODEL) is the profile whose tools are the Responses API's
# own kinds (function, custom `apply_patch`, client `tool_search`, hosted `web_search`).
CLAUDE_MODEL = "claude-opus-5-5"
CODEX_MODEL = "gpt-6.1-sol"
CODEX_TOOLS_MODEL = "gpt-5.5"


def codex_config(base_url: str, model: str | None = None) -> str:
    """The provider block a user puts in ~/.codex/config.toml to send Codex through the gateway
    (no `model` line: Codex's own default model)."""
    head = f'model = "{model}"\n' if model else ""
    return (f'{head}model_provider = "tierlane"\n\n[model_providers.tierlane]\nname = "tierlane"\n'
            f'base_url = "{base_url}/v1"\nwire_api = "responses"\nenv_key = "TIERLANE_API_KEY"\n')


def run(agent: Agent, base_url: str, workdir: Path, home: Path, prompt: str, *, timeout: float = 180,
        api_key: str = "tierlane-test-key", model: str | None = None,
        args: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """One non-interactive run of `agent` (its defaults, then `args`: e.g. permissions) in `workdir`,
    against the gateway at `base_url`."""
    home.mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
    }
    if agent is CLAUDE:
        env.update({
            "ANTHROPIC_BASE_URL": base_url,
            "ANTHROPIC_API_KEY": api_key,
            # nothing but the gateway: no telemetry, update checks or error reports
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
        })
        command = [str(install(agent)), "-p", prompt, *(["--model", model] if model else []), *args]
    else:
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(codex_config(base_url, model))
        env.update({"CODEX_HOME": str(codex_home), "TIERLANE_API_KEY": api_key})
        command = [str(install(agent)), "exec", "--skip-git-repo-check", *args, prompt]
    return subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def main(argv: list[str]) -> int:
    if argv[:1] != ["install"]:
        print("usage: python -m tests.support.agents install", file=sys.stderr)
        return 2
    for agent in AGENTS:
        print(f"{agent.spec}: {install(agent)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
