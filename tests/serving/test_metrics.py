"""The ``vllm_lowrank_*`` Prometheus metrics: the collector and the worker
state files on their own (fast), and ``/metrics`` of running servers (slow)
checked against the capacity vLLM logged and ranks computed independently."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import torch
from conftest import calibrated
from server_harness import Server, parse_metrics

from vllm_lowrank import metrics
from vllm_lowrank.config import LowRankConfig
from vllm_lowrank.factorization.plan import AttentionShape, uniform_plan
from vllm_lowrank.models.compression import ModelCompression

SHAPE = AttentionShape(hidden_size=64, num_heads=8, num_kv_heads=4, head_dim=16)


def _collect(directory, registry=None):
    from prometheus_client import CollectorRegistry, generate_latest

    registry = registry or CollectorRegistry()
    registry.register(metrics.LowRankCollector(str(directory), registry=registry))
    return parse_metrics(generate_latest(registry).decode())


class _Attn(torch.nn.Module):
    kv_cache_torch_dtype = torch.bfloat16


class _Model(torch.nn.Module):
    def __init__(self, compression):
        super().__init__()
        self.attn = _Attn()
        self._lowrank = compression


def test_no_state_means_disabled_and_no_ranks(tmp_path):
    samples = _collect(tmp_path / "missing")
    names = {n for n, _, _ in samples}
    assert ("vllm_lowrank_compression_enabled", {}, 0.0) in samples
    assert "vllm_lowrank_layer_rank" not in names
    assert "vllm_lowrank_kv_cache_capacity_tokens" not in names  # no engine yet


def test_published_state_is_exported(tmp_path, monkeypatch):
    from prometheus_client import CollectorRegistry, Gauge

    cfg = LowRankConfig(mode="lowrank", rank_fraction=0.5, head_group_size=2, rank_allocation="uniform")
    plans = {i: uniform_plan(cfg, SHAPE, i) for i in range(3)}
    c = ModelCompression(cfg=cfg, plans=plans, artifact=None, artifact_path=None)
    monkeypatch.setenv(metrics.STATE_DIR_ENV, str(tmp_path))
    assert metrics.publish(_Model(c), 2048).endswith("worker-dp0-pp0-tp0.json")

    registry = CollectorRegistry()
    info = Gauge("vllm:cache_config_info", "", ["engine", "kv_cache_size_tokens"],
                 registry=registry)
    info.labels(engine="0", kv_cache_size_tokens="4096").set(1)
    samples = _collect(tmp_path, registry)
    value = {n: v for n, labels, v in samples if not labels}
    assert value["vllm_lowrank_compression_enabled"] == 1
    assert value["vllm_lowrank_configured_rank_fraction"] == 0.5
    original = 3 * 2 * SHAPE.kv_width * 2  # bf16
    stored = sum(p.k_width + p.v_width for p in plans.values()) * 2
    assert value["vllm_lowrank_original_bytes_per_token"] == original
    assert value["vllm_lowrank_stored_bytes_per_token"] == stored
    assert value["vllm_lowrank_kv_compression_ratio"] == pytest.approx(original / stored)
    ranks = {(l["layer"], l["side"], l["group"]): v for n, l, v in samples
             if n == "vllm_lowrank_layer_rank"}
    assert len(ranks) == 3 * 2 * 2  # layers x sides x groups
    assert ranks[("1", "v", "1")] == plans[1].v_ranks[1]
    assert ("vllm_lowrank_kv_cache_capacity_tokens", {"engine": "0"}, 4096.0) in samples


def test_sequence_ratio_counts_the_exact_tokens(tmp_path, monkeypatch):
    """With the token-adaptive mode every layer also holds ``sink + recent + 1``
    tokens at the exact slot size: the per-sequence ratio counts them over
    ``max_model_len``; without it the two ratios agree."""
    import types

    from vllm_lowrank.format.exact import ExactSlot

    cfg = LowRankConfig(mode="lowrank", rank_fraction=0.5, head_group_size=2, rank_allocation="uniform")
    plans = {i: uniform_plan(cfg, SHAPE, i) for i in range(3)}
    c = ModelCompression(cfg=cfg, plans=plans, artifact=None, artifact_path=None)
    monkeypatch.setenv(metrics.STATE_DIR_ENV, str(tmp_path))
    model = _Model(c)
    latent = sum(p.k_width + p.v_width for p in plans.values()) * 2 // 3  # one layer, bf16
    slot = ExactSlot(SHAPE.kv_width, SHAPE.head_dim, torch.bfloat16, 16, 0, latent)
    for i in range(3):
        layer = torch.nn.Module()
        layer.__dict__["exact"] = types.SimpleNamespace(slot=slot, sink=32, recent=128)
        model.add_module(f"layer{i}", layer)
    metrics.publish(model, 1024)
    value = {n: v for n, labels, v in _collect(tmp_path) if not labels}
    original = 3 * 2 * SHAPE.kv_width * 2
    stored = 3 * latent
    per_sequence = 1024 * stored + (32 + 128 + 1) * 3 * slot.slot_bytes
    assert value["vllm_lowrank_kv_compression_ratio"] == pytest.approx(original / stored)
    assert value["vllm_lowrank_sequence_compression_ratio"] == pytest.approx(
        1024 * original / per_sequence)
    metrics.publish(_Model(c), 1024)  # no exact tokens: the same ratio
    value = {n: v for n, labels, v in _collect(tmp_path) if not labels}
    assert value["vllm_lowrank_sequence_compression_ratio"] == pytest.approx(original / stored)


def test_decode_paths_are_exported(tmp_path, monkeypatch):
    """Paths recorded after publish() rewrite the state: one gauge per path
    counting layers; a path recorded before publish() is kept for it."""
    cfg = LowRankConfig(mode="lowrank", rank_fraction=0.5, rank_allocation="uniform")
    plans = {i: uniform_plan(cfg, SHAPE, i) for i in range(3)}
    c = ModelCompression(cfg=cfg, plans=plans, artifact=None, artifact_path=None)
    monkeypatch.setenv(metrics.STATE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(metrics, "_WORKER", {"decode_paths": {}})
    ta = "token-adaptive+triton-latent-rope"  # a decoder name (attention.decoders)
    metrics.record_decode_path("model.layers.0.self_attn.attn", ta)
    metrics.publish(_Model(c), 2048)
    metrics.record_decode_path("model.layers.1.self_attn.attn", ta)
    metrics.record_decode_path("model.layers.2.self_attn.attn", "torch")
    paths = {l["path"]: v for n, l, v in _collect(tmp_path)
             if n == "vllm_lowrank_decode_layers"}
    assert paths == {ta: 2, "torch": 1}


def test_summary_reports_the_bits_in_force_per_layer():
    """The worker state says which bits each layer stores: the config's where no
    allocation fixed them, the allocation's per-layer choice where one did; and no
    global k_bits / v_bits that an allocation would contradict."""
    cfg = LowRankConfig(mode="lowrank", rank_fraction=0.5, head_group_size=2, rank_allocation="uniform",
                        k_bits=4, v_bits=8)
    plans = {i: uniform_plan(cfg, SHAPE, i) for i in range(3)}
    plain = ModelCompression(cfg=cfg, plans=plans, artifact=None, artifact_path=None)
    allocated = ModelCompression(cfg=cfg, plans=plans, artifact=None, artifact_path=None,
                                 bits={0: (8, 8), 1: (4, 2), 2: (2, 4)})
    for c, expected in ((plain, {i: [4, 8] for i in plans}),
                        (allocated, {0: [8, 8], 1: [4, 2], 2: [2, 4]})):
        state = json.loads(json.dumps(c.summary(2)))
        assert {int(i): layer["bits"] for i, layer in state["layers"].items()} == expected
        assert "k_bits" not in state and "v_bits" not in state


def test_info_reports_what_made_the_factors_and_no_path(tmp_path):
    """Full rank: identity (no SVD, no artifact basis); below it the artifact's
    method or weight SVD; the artifact label is its manifest digest, not its path."""
    from vllm_lowrank.calibration import artifact as art

    full_cfg = LowRankConfig(mode="lowrank", rank_fraction=1.0, head_group_size=2, rank_allocation="uniform")
    half_cfg = LowRankConfig(mode="lowrank", rank_fraction=0.5, head_group_size=2, rank_allocation="uniform")
    full = {i: uniform_plan(full_cfg, SHAPE, i) for i in range(3)}
    half = {i: uniform_plan(half_cfg, SHAPE, i) for i in range(3)}
    manifest = art.new_manifest(model_id="m", architecture="LlamaForCausalLM",
                                shape={"hidden_size": 64}, num_layers=3, fingerprint="f",
                                method="fisher", group_size=2, calibration={})
    artifact = art.Artifact(manifest, {})
    path = str(tmp_path / "secret-location")
    cases = [(full_cfg, full, None, "identity", "none"),
             (full_cfg, full, artifact, "identity", artifact.digest),
             (half_cfg, half, None, "svd", "none"),
             (half_cfg, half, artifact, "fisher", artifact.digest)]
    for cfg, plans, a, method, label in cases:
        state = ModelCompression(cfg=cfg, plans=plans, artifact=a,
                                 artifact_path=path if a else None).summary(2)
        assert (state["method"], state["artifact"]) == (method, label)
        assert path not in json.dumps(state)
    assert artifact.digest.startswith("blake2b:") and len(artifact.digest) == 8 + 32
    changed = art.Artifact({**manifest, "method": "kq"}, {})
    assert changed.digest != artifact.digest


def test_stale_state_dirs_of_dead_processes_are_removed(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"vllm-lowrank-metrics-{dead_pid}-0123abcd"
    live = tmp_path / f"vllm-lowrank-metrics-{os.getpid()}-0123abcd"
    other = tmp_path / "vllm-lowrank-metrics-notapid-x"
    for d in (stale, live, other):
        d.mkdir()
        (d / "worker-dp0-pp0-tp0.json").write_text("{}")
    assert metrics.remove_stale_state_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()


def test_tensor_parallel_shards_are_combined():
    def shard(tp, k, v):
        return {"enabled": True, "configured_rank_fraction": 0.5, "method": "svd", "artifact": "none",
                "layers": {"0": {"k_ranks": [k], "v_ranks": [v]}},
                "original_bytes_per_token": 256, "stored_bytes_per_token": 2 * (k + v),
                "parallel": {"dp": 0, "pp": 0, "tp": tp}}

    view = metrics.aggregate([shard(0, 8, 16), shard(1, 24, 32)])
    assert view["grouped"]
    assert view["ranks"] == {(0, "k", 0): 8, (0, "v", 0): 16, (0, "k", 1): 24, (0, "v", 1): 32}
    assert view["stored_bytes_per_token"] == 160
    assert view["compression_ratio"] == pytest.approx(512 / 160)
    assert metrics.aggregate([{"enabled": False}]) is None


def test_unreadable_state_is_skipped(tmp_path):
    (tmp_path / "worker-dp0-pp0-tp0.json").write_text("{truncated")
    assert metrics.read_states(str(tmp_path)) == []


# ---------------------------------------------------------------- servers

class OneServer:
    """At most one server alive in this module (2 shared CPU cores): asking for
    another setting stops the current one."""

    def __init__(self, model, log_dir):
        self.model, self.log_dir = model, log_dir
        self.key, self.server = None, None

    def get(self, *args) -> Server:
        if self.key != args:
            self.stop()
            self.server, self.key = Server(self.model, *args, log_dir=self.log_dir), args
        return self.server

    def stop(self):
        if self.server is not None:
            self.server.stop()
        self.key, self.server = None, None


@pytest.fixture(scope="module")
def servers(model_path, tmp_path_factory):
    one = OneServer(model_path, str(tmp_path_factory.mktemp("metrics-servers")))
    yield one
    one.stop()


def _scrape_lowrank(server) -> list[str]:
    """``curl 127.0.0.1:PORT/metrics | grep vllm_lowrank_`` (urllib without curl)."""
    if shutil.which("curl"):
        text = subprocess.run(["curl", "-sf", f"127.0.0.1:{server.port}/metrics"],
                              capture_output=True, text=True, check=True, timeout=30).stdout
    else:
        text = server.metrics_text()
    return [line for line in text.splitlines() if "vllm_lowrank_" in line]


def _logged_capacity(server) -> int:
    m = re.search(r"KV cache size: ([\d,]+) tokens", server.text())
    return int(m.group(1).replace(",", ""))


@pytest.mark.slow
def test_compressed_server_exports_the_values_in_force(servers, model_path):
    from transformers import AutoConfig

    from vllm_lowrank.calibration import artifact as art
    from vllm_lowrank.calibration.cache import auto_artifact_path
    from vllm_lowrank.models import compression as comp

    compressed_server = servers.get("--kv-compression", "lowrank",
                                    "--kv-compression-config", '{"rank_fraction": 0.5}')
    lines = _scrape_lowrank(compressed_server)
    samples = parse_metrics("\n".join(lines))
    value = {n: v for n, labels, v in samples if not labels}
    assert value["vllm_lowrank_compression_enabled"] == 1
    assert value["vllm_lowrank_configured_rank_fraction"] == 0.5

    # capacity: what vLLM logged when it allocated the cache
    capacity = {n: v for n, labels, v in samples if labels.get("engine") == "0"}
    assert capacity["vllm_lowrank_kv_cache_capacity_tokens"] == _logged_capacity(compressed_server)

    # ranks: recomputed here from the artifact the server used and the settings
    (info,) = [labels for n, labels, _ in samples if n == "vllm_lowrank_info"]
    hf = AutoConfig.from_pretrained(model_path)
    cfg = LowRankConfig.from_dict(calibrated({"mode": "lowrank", "rank_fraction": 0.5}))
    artifact = art.load_artifact(auto_artifact_path(model_path, cfg))
    assert info == {"method": "fisher", "artifact": artifact.digest}
    plans = comp.layer_plans(cfg, comp.model_shapes(hf), artifact)
    ranks = {(int(l["layer"]), l["side"]): v for n, l, v in samples
             if n == "vllm_lowrank_layer_rank"}
    expected = {}
    for i, p in plans.items():
        expected[(i, "k")], expected[(i, "v")] = p.k_width, p.v_width
    assert ranks == expected
    assert len(set(ranks.values())) > 2  # Fisher allocation: ranks differ across layers

    # bytes per token: float32 cache, 30 layers x 3 KV heads x 64
    original = hf.num_hidden_layers * 2 * hf.num_key_value_heads * hf.head_dim * 4
    stored = sum(ranks.values()) * 4
    assert value["vllm_lowrank_original_bytes_per_token"] == original
    assert value["vllm_lowrank_stored_bytes_per_token"] == stored
    assert value["vllm_lowrank_kv_compression_ratio"] == pytest.approx(original / stored)
    assert value["vllm_lowrank_kv_compression_ratio"] == pytest.approx(2.0, rel=0.03)
    # the capacity is what the configured memory holds at the stored width
    budget = int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30
    (cache_info,) = [labels for n, labels, _ in compressed_server.metrics()
                     if n == "vllm:cache_config_info"]
    block = int(cache_info["block_size"])
    assert capacity["vllm_lowrank_kv_cache_capacity_tokens"] * stored <= budget
    assert (capacity["vllm_lowrank_kv_cache_capacity_tokens"] + block) * stored > budget

    # decode paths: chosen at the first decode step on a CPU (every layer: torch)
    compressed_server.greedy(max_tokens=2)
    paths = {l["path"]: v for n, l, v in parse_metrics("\n".join(
        _scrape_lowrank(compressed_server))) if n == "vllm_lowrank_decode_layers"}
    assert paths == {"torch": hf.num_hidden_layers}


@pytest.mark.slow
def test_stock_server_reports_compression_off(servers):
    s = servers.get()
    text = "\n".join(_scrape_lowrank(s))
    assert "vllm_lowrank_compression_enabled 0.0" in text
    for absent in ("layer_rank", "configured_rank_fraction", "stored_bytes_per_token"):
        assert f"vllm_lowrank_{absent}" not in text
    assert re.search(r'vllm_lowrank_kv_cache_capacity_tokens\{engine="0"\} '
                     f"{_logged_capacity(s)}.0", text)
