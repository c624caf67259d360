"""The server tests' ``vllm serve``: :class:`vllm_lowrank.local_server.LocalServer`
with the tests' settings, ready on return."""

from __future__ import annotations

import os

from vllm_lowrank.local_server import VLLM, LocalServer, free_port, parse_metrics

__all__ = ["VLLM", "PROMPTS", "Server", "free_port", "parse_metrics"]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]


class Server(LocalServer):
    """``vllm serve MODEL`` served as ``m``, float32, eager, 2048-token context;
    waits for ``/health`` (up to 15 min).

    Args:
        model: Model folder.
        *args: Extra ``vllm serve`` arguments.
        log_dir: Folder for the server log.
        env: Extra environment variables.
    """

    def __init__(self, model, *args, log_dir, env=None):
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
