"""benchmarks/gpu_perplexity.py's plumbing: the GGUF carried in parts comes back
byte for byte (or refuses), per-domain log-likelihoods are summed from vLLM's
prompt log-probabilities as a naive loop does, configs map to the settings a
user gives, and the comparison table's ratios are the perplexities'."""

from __future__ import annotations

import json
import math
import types

import pytest
from conftest import benchmark_module

gp = benchmark_module("gpu_perplexity")


def test_split_parts_join_back_byte_for_byte(tmp_path):
    data = bytes(range(256)) * 41 + b"tail"  # 10,500 bytes: parts of 4,096, 4,096, 2,308
    src = tmp_path / "model.gguf"
    src.write_bytes(data)
    packed = tmp_path / "packed"
    packed.mkdir()
    manifest = gp.split_file(str(src), str(packed), 4096)
    assert [(packed / p).stat().st_size for p in manifest["parts"]] == [4096, 4096, 2308]
    out = tmp_path / "joined.gguf"
    gp.join_file(manifest, str(packed), str(out))
    assert out.read_bytes() == data


def test_join_refuses_a_changed_or_missing_part(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x" * 5000)
    manifest = gp.split_file(str(src), str(tmp_path), 2048)
    part = tmp_path / manifest["parts"][1]
    part.write_bytes(b"y" + part.read_bytes()[1:])
    with pytest.raises(ValueError, match="re-carry"):
        gp.join_file(manifest, str(tmp_path), str(tmp_path / "j"))
    part.unlink()
    with pytest.raises(FileNotFoundError):
        gp.join_file(manifest, str(tmp_path), str(tmp_path / "j"))


def _output(logprobs: list[float], window: list[int]):
    """A vLLM output whose prompt log-probability of ``window[i]`` is
    ``logprobs[i - 1]`` (the first token has none)."""
    entries = [None] + [{tok: types.SimpleNamespace(logprob=lp)}
                        for tok, lp in zip(window[1:], logprobs)]
    return types.SimpleNamespace(prompt_logprobs=entries)


def test_domain_nll_sums_each_domains_windows_in_order():
    windows = {"wiki": [[5, 6, 7], [8, 9, 10]], "code": [[1, 2, 3, 4]]}
    lps = [[-1.0, -2.0], [-0.5, -0.25], [-3.0, -1.0, -2.0]]
    outs = [_output(lp, w) for lp, w in zip(lps, [w for ws in windows.values() for w in ws])]
    got = gp.domain_nll(outs, windows)
    assert got["wiki"]["tokens"] == 4 and got["code"]["tokens"] == 3
    assert got["wiki"]["nll"] == pytest.approx(3.75)
    assert got["code"]["ppl"] == pytest.approx(math.exp(6.0 / 3))


def test_configs_are_presets_stock_or_json(tmp_path):
    assert gp.compression_of("stock", None) is None
    assert gp.compression_of("4x", None) == {"mode": "lowrank", "preset": "4x"}
    assert gp.compression_of('{"k_bits": 4}', None) == {"mode": "lowrank", "k_bits": 4}
    (tmp_path / "lossless").mkdir()
    assert gp.compression_of("lossless", str(tmp_path))["artifact"] == str(tmp_path / "lossless")
    assert "artifact" not in gp.compression_of("2x", str(tmp_path))  # none carried for it


def test_an_allocation_preset_runs_as_its_artifact(tmp_path):
    """``8x`` refuses ``artifact`` beside ``preset``: its carried allocation is
    served on its own (it fixes ranks, bits and serving settings; the engine
    gives it the block size it was allocated at, tests/engine/test_budget_engine.py)."""
    from vllm_lowrank.config import LowRankConfig
    from vllm_lowrank.errors import LowRankConfigError

    (tmp_path / "8x").mkdir()
    path = str(tmp_path / "8x")
    with pytest.raises(LowRankConfigError, match="allocates ranks and bits"):
        LowRankConfig.from_dict({"mode": "lowrank", "preset": "8x", "artifact": path})
    got = gp.compression_of("8x", str(tmp_path))
    assert got == {"mode": "lowrank", "artifact": path}
    assert LowRankConfig.from_dict(got).artifact == path
    assert gp.compression_of("8x", None) == {"mode": "lowrank", "preset": "8x"}


def test_compare_gives_ratios_of_the_perplexities(tmp_path):
    def rows(stock, preset):
        return [{"config": "stock", "domains": {"bbc": {"ppl": stock}}},
                {"config": "4x", "domains": {"bbc": {"ppl": preset}},
                 "decode_layers": {"post-rope-keys-cuda": 30}}]

    (tmp_path / "a.json").write_text(json.dumps(rows(20.0, 20.2)))
    (tmp_path / "b.json").write_text(json.dumps(rows(20.1, 20.1 * 1.012)))
    table = gp.compare(str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    row = [line for line in table.splitlines() if line.startswith("| 4x")][0].split(" | ")
    assert row[3] == "post-rope-keys-cuda"
    assert row[6] == f"{100 * (20.1 * 1.012 / 20.2 - 1):+.2f} %"  # B vs A
    assert row[7] == "+1.00 %" and row[8].startswith("+1.20 %")  # each against its stock
