"""CPU check of the long-step key-group path: preset 4x, one 4,096-token
wikipedia window, engine steps of 1,040 tokens (> GRAPH_SAFE_TOKENS: the
host-computed group ends) against 1,000 (the graph-safe path)."""
import json
from vllm_lowrank.embedded import prepare
from vllm_lowrank.evaluation import run_setting
MODEL = prepare("smollm2-135m")

for step in (1040, 1000):
    r = run_setting(dict(model=MODEL, compression={"mode": "lowrank", "preset": "4x"},
                         texts=["wikipedia"], num_windows=1, window=4096, block_size=32,
                         step_tokens=step))
    print(step, json.dumps(r["wikipedia"]), flush=True)
r = run_setting(dict(model=MODEL, compression=None, texts=["wikipedia"], num_windows=1,
                     window=4096, block_size=32, step_tokens=1040))
print("stock", json.dumps(r["wikipedia"]), flush=True)
