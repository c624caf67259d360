"""The server tests' ``vllm serve``: :class:`vllm_lowrank.local_server.LocalServer`
with the tests' settings, ready on return."""

from __future__ import annotations

import json
import os
import signal
import threading

from conftest import calibrated

from vllm_lowrank.local_server import VLLM, LocalServer, free_port, parse_metrics

__all__ = ["VLLM", "PROMPTS", "Server", "free_port", "parse_metrics"]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]


class Server(LocalServer):
    """``vllm serve MODEL`` served as ``m``, float32, eager, 2048-token context;
    waits for ``/health`` (up to 15 min).

    Args:
        model: Model folder.
        *args: Extra ``vllm serve`` arguments; a ``--kv-compression-config``
            JSON gets the suite's calibration size (``conftest.calibrated``).
        log_dir: Folder for the server log.
        env: Extra environment variables.
    """

    def __init__(self, model, *args, log_dir, env=None):
        args = list(args)
        if "--kv-compression-config" in args:  # the suite's calibration size
            i = args.index("--kv-compression-config") + 1
            args[i] = json.dumps(calibrated(json.loads(args[i])))
        super().__init__(model, ["--served-model-name", "m", "--dtype", "float32",
                                 "--max-model-len", "2048", "--enforce-eager", *args],
                         log_dir=log_dir, env={**os.environ, **(env or {})})
        self.wait_ready(900)

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

    def sigterm_in_flight(self, prompt: str, max_tokens: int, timeout: float = 300):
        """Send SIGTERM while a greedy completion of ``prompt`` (``max_tokens``
        tokens, ``ignore_eos``) is running, then wait for both.

        Returns:
            ``(result, exit_code)``: ``result`` holds ``status`` and ``body`` (the
            JSON reply) or ``error`` (the client's exception); ``exit_code`` is
            the server's (``None`` if it did not exit within 120 s).
        """
        import subprocess

        import requests

        result = {}

        def ask() -> None:
            try:
                r = requests.post(self.url + "/v1/completions", timeout=timeout, json={
                    "model": "m", "prompt": prompt, "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0})
                result["status"], result["body"] = r.status_code, r.json()
            except Exception as e:  # noqa: BLE001 (returned to the test)
                result["error"] = repr(e)

        thread = threading.Thread(target=ask)
        thread.start()
        running = self.wait_metric("vllm:num_requests_running", lambda v: v >= 1, 60)
        assert running >= 1, "the request never started running"
        self.proc.send_signal(signal.SIGTERM)
        thread.join(timeout)
        try:
            code = self.proc.wait(120)
        except subprocess.TimeoutExpired:
            code = None
        return result, code
