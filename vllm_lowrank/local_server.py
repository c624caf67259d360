"""A ``vllm serve`` subprocess on a free loopback port, and a reader of its
Prometheus ``/metrics`` page.

One implementation for everything that drives a real server on this machine:
the README's demo (``scripts/demo.py``), the load benchmark
(``benchmarks/serve_load.py``) and the server tests (``tests/server_harness.py``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence

HOST = "127.0.0.1"
VLLM = os.path.join(os.path.dirname(sys.executable), "vllm")


def free_port() -> int:
    """A TCP port free on ``HOST`` right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """``(sample name, labels, value)`` of every sample in Prometheus text
    format (parsed by ``prometheus_client.parser``)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]


def metric_totals(text: str) -> dict[str, float]:
    """``{sample name: value}`` summed over label sets, from Prometheus text."""
    totals: dict[str, float] = {}
    for name, _, value in parse_metrics(text):
        totals[name] = totals.get(name, 0.0) + value
    return totals


class LocalServer:
    """``vllm serve MODEL --host 127.0.0.1 --port <free> *args``, its output in
    ``<log_dir>/<name>-<port>.log``. Starting does not wait: call
    :meth:`wait_ready`.

    Args:
        model: Model folder or id.
        args: Further ``vllm serve`` arguments.
        log_dir: Folder for the log file.
        name: Prefix of the log file's name.
        env: The server's whole environment (default: this process's).
    """

    def __init__(self, model: str, args: Sequence[str], *, log_dir: str, name: str = "server",
                 env: Mapping[str, str] | None = None) -> None:
        self.port = free_port()
        self.log_path = os.path.join(log_dir, f"{name}-{self.port}.log")
        self.log = open(self.log_path, "w")
        cmd = [VLLM, "serve", model, "--host", HOST, "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ if env is None else env))

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://{HOST}:{self.port}"

    def text(self) -> str:
        """The server's output so far."""
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = 900) -> None:
        """Wait until ``/health`` answers.

        Raises:
            RuntimeError: the server exited first (log tail attached).
            TimeoutError: not ready within ``timeout`` seconds (the server is
                stopped first).
        """
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; log "
                                   f"{self.log_path}:\n" + self.text()[-3000:])
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(1)
        self.stop()
        raise TimeoutError(f"vllm serve not ready after {timeout:.0f} s; log {self.log_path}:\n"
                           + self.text()[-3000:])

    def metrics_text(self) -> str:
        """The raw ``/metrics`` page."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        """Parsed ``/metrics`` samples (see :func:`parse_metrics`)."""
        return parse_metrics(self.metrics_text())

    def metric(self, name: str) -> float:
        """Sum over label sets of the samples named ``name``.

        Raises:
            KeyError: no such sample.
        """
        return metric_totals(self.metrics_text())[name]

    def wait_metric(self, name: str, predicate, timeout: float) -> float:
        """Poll :meth:`metric` every 0.2 s until ``predicate(value)`` holds or
        ``timeout`` seconds pass; the last value read (the caller asserts on it)."""
        deadline = time.time() + timeout
        while True:
            value = self.metric(name)
            if predicate(value) or time.time() > deadline:
                return value
            time.sleep(0.2)

    def stop(self) -> int:
        """SIGTERM, wait up to 60 s (then kill); closes the log; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
