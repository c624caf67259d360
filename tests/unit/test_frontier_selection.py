"""``benchmarks/frontier.py --only``: a setting's whole name selects it alone,
any other string every setting whose name contains it."""

from __future__ import annotations

from conftest import benchmark_module


def _frontier():
    return benchmark_module("frontier")


def test_a_whole_name_selects_that_setting_alone():
    fr = _frontier()
    name = "allocated 8x, sink 32 + recent 256 int8"
    longer = [n for n in fr.SETTINGS if n != name and name in n]
    assert name in fr.SETTINGS and longer  # the case the rule exists for
    chosen = [n for n in fr.SETTINGS if fr.selected(n, [name])]
    assert chosen == [name]


def test_a_substring_selects_every_setting_containing_it():
    fr = _frontier()
    chosen = [n for n in fr.SETTINGS if fr.selected(n, ["preset "])]
    assert chosen == [n for n in fr.SETTINGS if n.startswith("preset ")] and len(chosen) == 4
    assert all(fr.selected(n, None) for n in fr.SETTINGS)


def test_the_gpu_column_joins_equal_memory_rows_by_config(tmp_path):
    """``--gpu``: each setting's output tokens/s over stock's, from the
    equal-memory load rows of one ``gpu_serving.py --json`` file; every setting
    named in ``GPU_CONFIGS`` is a frontier setting served by a real config."""
    import json

    import pytest

    fr = _frontier()
    gs = benchmark_module("gpu_serving")
    assert set(fr.GPU_CONFIGS) <= set(fr.SETTINGS)
    assert set(fr.GPU_CONFIGS.values()) <= set(gs.CONFIGS)
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps([
        {"config": "stock", "mode": "load", "out_tok_s": 2000.0},
        {"config": "preset-4x", "mode": "load", "out_tok_s": 5000.0},
        {"config": "default", "mode": "shapes", "decode_ms": 10.0},
        {"config": "pr-k4v4", "mode": "load", "error": "timeout"}]))
    assert fr.gpu_ratios(str(path)) == {"stock": 1.0, "preset-4x": 2.5}
    path.write_text(json.dumps([{"config": "default", "mode": "load", "out_tok_s": 1.0}]))
    with pytest.raises(SystemExit, match="no stock row"):
        fr.gpu_ratios(str(path))


def test_each_setting_gets_a_block_size_its_engine_accepts():
    """Without ``--block-size`` every setting gets a block the plugin accepts (its
    own check, ``exact_tokens``: the ``4x`` preset's key groups span 64 tokens, and
    a block of 32 is refused before the engine starts), and the preset's own;
    ``--block-size`` overrides."""
    import pytest

    from vllm_lowrank.config import LowRankConfig, LowRankConfigError
    from vllm_lowrank.format.exact import exact_tokens

    fr = _frontier()
    assert fr.setting_block({"preset": "4x"}, None) == 64
    assert fr.setting_block({"preset": "2x"}, None) == 32
    assert fr.setting_block(None, None) == 32
    assert fr.setting_block({"preset": "4x"}, 128) == 128
    with pytest.raises(LowRankConfigError, match="must divide the KV block size 32"):
        exact_tokens(LowRankConfig.from_dict({"mode": "lowrank", "preset": "4x"}), 32)
    for name, (_, cfg) in fr.SETTINGS.items():
        if cfg is not None and "allocate" not in cfg:
            exact_tokens(LowRankConfig.from_dict({"mode": "lowrank", **cfg}),
                         fr.setting_block(cfg, None))
