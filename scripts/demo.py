"""The main job: serve the embedded model with a latent KV cache and ask it.

1. Start ``vllm serve <SmolLM2-135M-Instruct> --kv-compression lowrank`` on
   127.0.0.1 (default settings: the ``2x`` preset, full-rank post-RoPE
   latents with 8-bit keys and 4-bit values).
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
import tempfile

from vllm_lowrank import embedded
from vllm_lowrank.local_server import LocalServer

CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens")
RATIO = re.compile(r"compression ratio ([\d.]+)x")


def start(model: str, extra: list[str], name: str) -> LocalServer:
    """``vllm serve`` of the demo (served as ``smollm2``, float32, 1 GiB cache)."""
    return LocalServer(model, ["--served-model-name", "smollm2", "--dtype", "float32",
                               "--max-model-len", "4096", "--enforce-eager", *extra],
                       log_dir=tempfile.gettempdir(), name=f"demo-{name}",
                       env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})


def find(server: LocalServer, pattern: re.Pattern) -> str | None:
    """First group of ``pattern`` in the server's log."""
    m = pattern.search(server.text())
    return m.group(1) if m else None


def main() -> None:
    from openai import OpenAI

    model = embedded.prepare()
    print(f"model: SmolLM2-135M-Instruct (embedded) at {model}")
    print("starting vllm serve --kv-compression lowrank ...", flush=True)
    server = start(model, ["--kv-compression", "lowrank"], "lowrank")
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
        compressed = find(server, CAPACITY)
        ratio = find(server, RATIO)
    finally:
        server.stop()
    print("starting vllm serve without compression (for its capacity) ...", flush=True)
    stock = start(model, [], "stock")
    try:
        stock.wait_ready()
        uncompressed = find(stock, CAPACITY)
    finally:
        stock.stop()
    c, u = int(compressed.replace(",", "")), int(uncompressed.replace(",", ""))
    print(f"\nKV cache capacity reported by vLLM (VLLM_CPU_KVCACHE_SPACE=1 GiB):\n"
          f"  without compression: {u:,} tokens\n"
          f"  with --kv-compression lowrank: {c:,} tokens ({c / u:.2f}x)\n"
          f"  compression ratio (original KV bytes / stored bytes per token): {ratio}x")


if __name__ == "__main__":
    main()
