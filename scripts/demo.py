"""The main job: serve the embedded model with a latent KV cache and ask it.

1. Start ``vllm serve <SmolLM2-135M-Instruct> --kv-compression lowrank`` on
   127.0.0.1 (default settings: ratio 0.5, Fisher-calibrated bases).
2. Send a chat and a completion request through the ``openai`` client, print
   the answers.
3. Stop it; start the same server without compression to read its capacity.
4. Print the KV capacity vLLM reported for both and the compression ratio.

Both servers get the same ``VLLM_CPU_KVCACHE_SPACE`` (1 GiB) so their
capacities compare. Run: ``.venv/bin/python scripts/demo.py`` (``make demo``).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from vllm_lowrank import embedded

HOST = "127.0.0.1"
CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens")
RATIO = re.compile(r"compression ratio ([\d.]+)x")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    """A ``vllm serve`` subprocess with its log in a temporary file."""

    def __init__(self, model: str, extra: list[str], name: str) -> None:
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-", suffix=".log",
                                               delete=False)
        cmd = [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", model,
               "--host", HOST, "--port", str(self.port), "--served-model-name", "smollm2",
               "--dtype", "float32", "--max-model-len", "4096", "--enforce-eager", *extra]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log:\n"
                                   + self.text()[-3000:])
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError("server did not become ready")

    def text(self) -> str:
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def find(self, pattern: re.Pattern) -> str | None:
        m = pattern.search(self.text())
        return m.group(1) if m else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def main() -> None:
    from openai import OpenAI

    model = embedded.prepare()
    print(f"model: SmolLM2-135M-Instruct (embedded) at {model}")
    print("starting vllm serve --kv-compression lowrank ...", flush=True)
    server = Server(model, ["--kv-compression", "lowrank"], "lowrank")
    try:
        server.wait_ready()
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        chat = client.chat.completions.create(
            model="smollm2", temperature=0, max_tokens=32,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        print(f"chat       > What is the capital of France?\n"
              f"           < {chat.choices[0].message.content.strip()}")
        comp = client.completions.create(model="smollm2", prompt="The capital of France is",
                                         temperature=0, max_tokens=16)
        print(f"completion > The capital of France is\n"
              f"           < {comp.choices[0].text.strip()}")
        compressed = server.find(CAPACITY)
        ratio = server.find(RATIO)
    finally:
        server.stop()
    print("starting vllm serve without compression (for its capacity) ...", flush=True)
    stock = Server(model, [], "stock")
    try:
        stock.wait_ready()
        uncompressed = stock.find(CAPACITY)
    finally:
        stock.stop()
    c, u = int(compressed.replace(",", "")), int(uncompressed.replace(",", ""))
    print(f"\nKV cache capacity reported by vLLM (VLLM_CPU_KVCACHE_SPACE=1 GiB):\n"
          f"  without compression: {u:,} tokens\n"
          f"  with --kv-compression lowrank: {c:,} tokens ({c / u:.2f}x)\n"
          f"  compression ratio (original KV bytes / stored bytes per token): {ratio}x")


if __name__ == "__main__":
    main()
