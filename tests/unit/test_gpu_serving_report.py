"""``benchmarks/gpu_serving.py``'s ratio columns (against the fastest stock backend
with a bf16 cache) and its FlashInfer engines' environment; the engines need a GPU."""

from __future__ import annotations

from conftest import benchmark_module

gs = benchmark_module("gpu_serving")


def _load(config, tok_s, fit=32, **kw):
    return dict(config=config, mode="load", out_tok_s=tok_s, fit_seqs=fit, **kw)


def test_load_ratios_are_against_the_fastest_bf16_stock_backend():
    rows = [_load("stock", 2700.0), _load("stock-flashinfer", 3000.0),
            _load("stock-flashinfer-fp8", 5000.0, fit=64),  # a compressed cache: not a reference
            _load("stock-all-memory", 6500.0, fit=400),     # more memory: not a reference
            _load("default", 4500.0, fit=81), dict(config="g1", mode="load", error="boom")]
    text = gs.report(rows)
    assert "ratios vs stock-flashinfer (the fastest stock backend, bf16 KV)" in text
    by = {r["config"]: r for r in rows}
    assert by["default"]["ref"] == "stock-flashinfer"
    assert by["default"]["tok_s_vs_stock"] == 1.5 and by["default"]["fit_vs_stock"] == 2.53
    assert by["stock"]["tok_s_vs_stock"] == 0.9 and by["stock-flashinfer"]["tok_s_vs_stock"] == 1.0
    assert "ref" not in by["g1"]
    # every row against each stock row, FP8 and all-memory included
    each = text.split("output tokens/s vs each stock row:")[1]
    assert "| default | 4500.0 | 1.67 | 1.5 | 0.9 | 0.69 |" in each
    assert ("| config | out_tok_s | vs stock | vs stock-flashinfer | vs stock-flashinfer-fp8 "
            "| vs stock-all-memory |") in text


def test_shape_ratios_take_the_fastest_stock_row_of_each_shape():
    def row(config, b, ms, pre=1.0):
        return dict(config=config, mode="shapes", batch=b, context=4096, decode_ms=ms,
                    prefill_s=pre, path="stock")
    rows = [row("stock", 1, 8.0), row("stock-flashinfer-xqa", 1, 7.0),
            row("stock", 16, 12.0), row("stock-flashinfer-xqa", 16, 13.0),
            row("stock-flashinfer-fp8", 16, 6.0), row("default", 1, 8.4, 0.5),
            row("default", 16, 11.4)]
    text = gs.report(rows)
    assert "at each shape: 1x4096 stock-flashinfer-xqa, 16x4096 stock" in text
    d1, d16 = rows[5], rows[6]
    assert (d1["ref"], d1["decode_vs_stock"], d1["prefill_vs_stock"]) == (
        "stock-flashinfer-xqa", 1.2, 0.5)
    assert (d16["ref"], d16["decode_vs_stock"]) == ("stock", 0.95)
    assert "| default 16x4096 | 11.4 | 0.95 | 0.88 | 1.9 |" in text


def test_no_stock_row_leaves_the_ratios_out():
    rows = [_load("default", 4500.0)]
    assert "ratios vs none (no stock row ran)" in gs.report(rows)
    assert "tok_s_vs_stock" not in rows[0]


def test_flashinfer_engines_alone_see_flashinfer(tmp_path):
    site = tmp_path / "fi"
    (site / "flashinfer").mkdir(parents=True)
    env = {"PYTHONPATH": "/tmp/gpuvllm_site", "GPUVLLM_FLASHINFER_SITE": str(site)}
    assert gs.engine_env(env, "stock") == env
    assert gs.engine_env(env, "default") == env
    fi = gs.engine_env(env, "stock-flashinfer-fp8")
    assert fi["PYTHONPATH"] == f"/tmp/gpuvllm_site:{site}"
    assert "VLLM_HAS_FLASHINFER_CUBIN" not in fi
    assert gs.engine_env(env, "stock-flashinfer-xqa")["VLLM_HAS_FLASHINFER_CUBIN"] == "1"
    for name in ("stock-flashinfer", "stock-flashinfer-fp8", "stock-flashinfer-xqa",
                 "stock-flashinfer-fp8-xqa"):
        assert gs.CONFIGS[name]["backend"] == "FLASHINFER"
        assert gs.is_stock(name) and gs.is_reference(name) == ("fp8" not in name)


def test_flashinfer_needs_the_carried_package_and_the_patched_backend(tmp_path):
    vllm_site = tmp_path / "site"
    backend = vllm_site / "vllm/v1/attention/backends/flashinfer.py"
    backend.parent.mkdir(parents=True)
    backend.write_text("torch.ops._C_cache_ops.reshape_and_cache_flash(\n")
    env = {"GPUVLLM_SITE": str(vllm_site)}
    assert gs._flashinfer_missing("stock", env) is None
    assert gs._flashinfer_missing("stock-flashinfer", {}) is None  # not the GPU recipe
    assert "no flashinfer-python" in gs._flashinfer_missing("stock-flashinfer", env)
    (tmp_path / "fi/flashinfer").mkdir(parents=True)
    env["GPUVLLM_FLASHINFER_SITE"] = str(tmp_path / "fi")
    assert "--flashinfer" in gs._flashinfer_missing("stock-flashinfer", env)
    backend.write_text("_gpuvllm_cache_write(  # gpuvllm patch\n")
    assert gs._flashinfer_missing("stock-flashinfer", env) is None
