"""Helpers shared by the server tests: a ``vllm serve`` subprocess on 127.0.0.1
and a reader of its Prometheus ``/metrics`` text."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

VLLM = os.path.join(os.path.dirname(sys.executable), "vllm")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_SAMPLE = re.compile(r'^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """``(name, labels, value)`` of every sample in Prometheus text format."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")),
                        float(m.group(3))))
    return out


class Server:
    """``vllm serve MODEL`` on a free loopback port, float32, eager, 2048-token
    context; the log goes to ``log_dir``. Waits for ``/health`` (up to 15 min).

    Args:
        model: Model folder.
        *args: Extra ``vllm serve`` arguments.
        log_dir: Folder for the server log.
        env: Extra environment variables.
    """

    def __init__(self, model, *args, log_dir, env=None):
        self.port = free_port()
        self.log_path = os.path.join(log_dir, f"server-{self.port}.log")
        self.log = open(self.log_path, "w")
        cmd = [VLLM, "serve", model, "--host", "127.0.0.1", "--port", str(self.port),
               "--served-model-name", "m", "--dtype", "float32", "--max-model-len", "2048",
               "--enforce-eager", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        deadline = time.time() + 900
        while time.time() < deadline:
            assert self.proc.poll() is None, self.text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                time.sleep(1)
        raise TimeoutError(self.text()[-3000:])

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def text(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="x")

    def greedy(self, prompts=PROMPTS, max_tokens=24):
        out = []
        for p in prompts:
            r = self.client().completions.create(model="m", prompt=p, temperature=0,
                                                 max_tokens=max_tokens, logprobs=1)
            out.append(r.choices[0].logprobs.tokens)
        return out

    def metrics_text(self) -> str:
        """The raw ``/metrics`` page."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            return r.read().decode()

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        """Parsed ``/metrics`` samples (see :func:`parse_metrics`)."""
        return parse_metrics(self.metrics_text())

    def metric(self, name: str) -> float:
        """Sum of the samples named ``name``.

        Raises:
            KeyError: no such sample.
        """
        values = [v for n, _, v in self.metrics() if n == name]
        if not values:
            raise KeyError(name)
        return sum(values)

    def stop(self) -> int | None:
        """SIGTERM, wait up to 60 s (then kill); returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
