"""Calibration on a chosen device and dtype (``vllm-lowrank calibrate --device
--dtype``): the memory estimate and its refusal, the progress lines, and a GPU
run against the CPU run of the same checkpoint (``gpu``-marked)."""

from __future__ import annotations

import contextlib
import json
import logging
import os

import pytest
import torch

from vllm_lowrank.calibration import device as cd
from vllm_lowrank.config import LowRankConfigError


def _tiny_llama(path, tokenizer_dir: str) -> str:
    """A random-weight 2-layer Llama (4 query / 2 KV heads of 32) saved with
    the tokenizer of ``tokenizer_dir``: a checkpoint any machine can make."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=2048)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@contextlib.contextmanager
def _plugin_log():
    """The messages of the ``vllm.lowrank`` logger at INFO while in the block,
    read by a handler on that logger itself (vLLM's logging configuration,
    once vLLM is imported, may stop them before the root logger)."""
    log = logging.getLogger("vllm.lowrank")
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    level, disabled = log.level, log.disabled
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.disabled = False
    try:
        yield messages
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.disabled = disabled


def _gpu_case(tmp_path, monkeypatch) -> str:
    """The tiny Llama of a GPU-against-CPU test, with the SmolLM2 tokenizer of
    the GPU machine's model folder (``GPUVLLM_MODELS``) or of the embedded
    model; float32 matmuls without TF32 for the duration of the test."""
    if "GPUVLLM_MODELS" in os.environ:
        tokenizer = os.path.join(os.environ["GPUVLLM_MODELS"], "smollm2-135m-shape")
    else:
        from vllm_lowrank import embedded

        tokenizer = embedded.prepare()
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    return _tiny_llama(tmp_path / "tiny", tokenizer)


TEXT = [" ".join(f"The {w} of item {i} is {i * 7 % 13}." for i in range(400)
                 for w in ("colour", "weight"))]
"""Calibration text for the random-weight model: any tokens will do."""


def test_checkpoint_parameters_counts_the_loaded_model(model_path):
    """The header-only count equals the parameters of the loaded model
    (tied embeddings stored once, counted once)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    assert cd.checkpoint_parameters(model_path) == sum(p.numel() for p in model.parameters())


def test_peak_estimate_scales_with_dtype_and_gradients(model_path):
    """bfloat16 halves the weights and activations, not the float64 statistics;
    gradients keep every layer's activations."""
    fp32 = cd.peak_bytes(model_path, torch.float32, window=1024, gradients=True)
    bf16 = cd.peak_bytes(model_path, torch.bfloat16, window=1024, gradients=True)
    fwd = cd.peak_bytes(model_path, torch.float32, window=1024, gradients=False)
    runtime = cd.RUNTIME_BYTES
    assert bf16 - runtime < fp32 - runtime < 2 * (bf16 - runtime)
    assert fwd < fp32 / 2
    weights = cd.checkpoint_parameters(model_path) * 4
    assert fwd > weights + runtime


def test_too_little_memory_is_refused_before_loading(model_path, monkeypatch):
    """A run whose estimate exceeds the free memory is refused naming both and
    the fixes; nothing is loaded (the model loader is not reached)."""
    from vllm_lowrank.calibration import calibrate as cal

    page = os.sysconf("SC_PAGE_SIZE")
    monkeypatch.setattr(cd.os, "sysconf",
                        lambda name: 1000 if name == "SC_AVPHYS_PAGES" else page)
    monkeypatch.setattr(cal, "load_hf_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(LowRankConfigError, match=r"needs about .* GiB.*--dtype bfloat16"):
        cal.calibrate_model(model_path, method="fisher", num_tokens=1024)


@pytest.mark.parametrize("argv, fragment", [
    (["--device", "tpu"], "is not a device"),
    (["--device", "mps"], "calibration runs on cpu or cuda"),
    (["--device", "cuda:7"], "CUDA device"),
])
def test_bad_device_is_one_line(model_path, argv, fragment, capsys):
    """A device the run cannot use: one ``vllm-lowrank: error:`` line, exit 2."""
    from vllm_lowrank.cli import main

    with pytest.raises(SystemExit) as e:
        main(["calibrate", model_path, "--output", "unused", "--tokens", "1024", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2
    assert err[-1].startswith("vllm-lowrank: error:") and fragment in err[-1]


def test_bfloat16_calibration_matches_float32(tmp_path, model_path):
    """``calibrate --dtype bfloat16`` (CLI) gives the float32 bases up to
    bfloat16 rounding: the leading energies agree within 5 %, and the leading
    key subspace of every layer overlaps >= 0.95; the manifest records the
    dtype and the device. Progress lines name the windows."""
    from vllm_lowrank.calibration import artifact as art
    from vllm_lowrank.cli import main

    runs = {}
    with _plugin_log() as lines:
        for dtype in ("float32", "bfloat16"):
            out = tmp_path / dtype
            main(["calibrate", model_path, "--output", str(out), "--method", "whitened",
                  "--tokens", "2048", "--dtype", dtype])
            runs[dtype] = art.load_artifact(str(out))
            cal = json.loads((out / "manifest.json").read_text())["calibration"]
            assert (cal["device"], cal["dtype"]) == ("cpu", dtype)
    assert any("needs about" in m for m in lines)
    assert any("calibration windows 2/2" in m for m in lines)
    for i, (k32, _) in runs["float32"].bases.items():
        k16 = runs["bfloat16"].bases[i][0]
        for a, b in zip(k32, k16):
            e32, e16 = a.energy[:8], b.energy[:8]
            assert torch.allclose(e16, e32, rtol=0.05), (i, e32, e16)
            # principal angles between the leading 8-column key subspaces
            qa, qb = torch.linalg.qr(a.b[:8].T)[0], torch.linalg.qr(b.b[:8].T)[0]
            overlap = torch.linalg.svdvals(qa.T @ qb).min()
            assert overlap >= 0.95, (i, overlap)


def test_progress_logs_each_tenth_off_a_terminal():
    """Off a terminal (a log, a Job), progress is an INFO line per tenth."""
    from vllm_lowrank.calibration.collect import progress

    with _plugin_log() as messages:
        assert list(progress(range(20), "windows")) == list(range(20))
    lines = [m for m in messages if "windows" in m]
    assert len(lines) == 10 and lines[-1].startswith("vllm-lowrank: windows 20/20")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["fisher", "kq"])
def test_cuda_calibration_matches_the_cpu(tmp_path, monkeypatch, method):
    """The same checkpoint and text calibrated on the GPU and on the CPU (both
    float32) give the same bases: energies within 1e-3 relative, leading
    subspaces overlapping >= 0.999."""
    from vllm_lowrank.calibration.calibrate import calibrate_model

    path = _gpu_case(tmp_path, monkeypatch)
    cpu = calibrate_model(path, method=method, num_tokens=2048, documents=TEXT)
    gpu = calibrate_model(path, method=method, num_tokens=2048, documents=TEXT, device="cuda")
    assert gpu.manifest["calibration"]["device"].startswith("cuda")
    for i in cpu.bases:
        for side_c, side_g in zip(cpu.bases[i], gpu.bases[i]):
            for a, b in zip(side_c, side_g):
                assert b.a.device.type == "cpu"
                k = 8
                assert torch.allclose(b.energy[:k], a.energy[:k], rtol=1e-3), (i, method)
                qa, qb = torch.linalg.qr(a.b[:k].T)[0], torch.linalg.qr(b.b[:k].T)[0]
                assert torch.linalg.svdvals(qa.T @ qb).min() >= 0.999


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_allocation_matches_the_cpu(tmp_path, monkeypatch):
    """A byte-budget allocation (token-adaptive, per-channel keys) measured on
    the GPU equals the one measured on the CPU: the same ranks and bits per
    layer, objectives within 1e-3 relative."""
    from vllm_lowrank.calibration.allocate import budget_artifact, serving_config
    from vllm_lowrank.calibration.calibrate import calibrate_model

    path = _gpu_case(tmp_path, monkeypatch)
    base = calibrate_model(path, method="fisher", num_tokens=2048, documents=TEXT)
    cfg = serving_config({"token_adaptive": True, "sink_tokens": 32, "recent_tokens": 128,
                          "k_quant": "channel"})
    kw = dict(ratio=4.0, context=1024, block_size=32, num_windows=2, documents=TEXT,
              choose_knobs=False)
    cpu, r_cpu = budget_artifact(path, base, cfg, **kw)
    gpu, r_gpu = budget_artifact(path, base, cfg, device="cuda", **kw)
    for key in ("layers", "bits", "serving"):
        assert gpu.manifest["ranks"][key] == cpu.manifest["ranks"][key], key
    assert r_gpu["objective_nats"] == pytest.approx(r_cpu["objective_nats"], rel=1e-3)
