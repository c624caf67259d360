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
