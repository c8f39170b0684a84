"""The real upstream of the integration tests: llama-cpp-python's OpenAI-compatible server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from edge_engine import bundled_model_path

UPSTREAM_MODEL = "smollm2-upstream"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LlamaServer:
    """`python -m llama_cpp.server` on loopback serving the bundled SmolLM2 GGUF."""

    def __init__(self, log_path: Path, n_ctx: int = 2048) -> None:
        self.port = free_port()
        self.log = open(log_path, "wb")
        cmd = [
            sys.executable, "-m", "llama_cpp.server",
            "--model", str(bundled_model_path()),
            "--model_alias", UPSTREAM_MODEL,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--n_ctx", str(n_ctx), "--n_threads", "1", "--verbose", "False",
            # Like a GPU server, finish every request it has; by default llama_cpp.server drops a
            # running request when the next one arrives.
            "--interrupt_requests", "False",
        ]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._wait()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _wait(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(self.base_url + "/models", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.25)
        raise RuntimeError("llama_cpp.server did not come up in time")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
