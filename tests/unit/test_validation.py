"""Every bad input of issue 23 is refused before any engine starts, with one
``vllm-lowrank: error:`` line and exit code 2, through the real hooks: the
``--kv-compression-config`` argparse action, ``EngineArgs.create_engine_config``
as called from the command line (no engine process is started), and the
``vllm-lowrank`` command line.

An artifact with SmolLM2's geometry and fingerprint (random bases) is the
valid starting point of the artifact cases; it is accepted as is.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil

import pytest
import torch

from vllm_lowrank import patches
from vllm_lowrank.calibration import artifact as art
from vllm_lowrank.config import LowRankConfig
from vllm_lowrank.format.exact import (
    POST_ROPE_PREFILL_CHUNK_TOKENS,
    PREEMPTION_WATERMARK,
    PREFILL_CHUNK_TOKENS,
)

MAX_MODEL_LEN = 512


def _refused(capsys, call) -> str:
    """Run ``call``; assert it exits 2 printing one ``vllm-lowrank: error:``
    line; return that line. Logging is off meanwhile: vLLM's log handlers
    write to the stderr of whichever test first configured them, and the
    refusal itself is a plain print."""
    capsys.readouterr()
    logging.disable(logging.CRITICAL)
    try:
        with pytest.raises(SystemExit) as info:
            call()
    finally:
        logging.disable(logging.NOTSET)
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("vllm-lowrank: error: "), lines[0]
    return lines[0]


def _config_flag(text: str) -> None:
    """What ``vllm serve ... --kv-compression-config TEXT`` runs at parse time."""
    action = patches._ConfigAction(option_strings=["--kv-compression-config"],
                                   dest="kv_compression_config")
    action(argparse.ArgumentParser(), argparse.Namespace(), text)


def _engine_config(model: str, compression: dict) -> None:
    """What ``vllm serve MODEL`` runs in its front end before starting an engine."""
    from vllm.engine.arg_utils import EngineArgs

    patches.apply()
    args = EngineArgs(model=model, dtype="float32", max_model_len=MAX_MODEL_LEN,
                      additional_config={"kv_compression": {"mode": "lowrank", **compression}})
    setattr(args, patches._CLI_MARK, True)  # as from_cli_args marks it
    args.create_engine_config()


# ------------------------------------------------------------ config text
def _binary(tmp_path):
    path = tmp_path / "binary.json"
    path.write_bytes(bytes(range(256)) * 4)
    return str(path)


def _nested(tmp_path):
    path = tmp_path / "nested.json"
    path.write_text('{"ratio": ' + "[" * 200_000 + "]" * 200_000 + "}")
    return str(path)


def _fifo(tmp_path):
    path = tmp_path / "fifo.json"
    os.mkfifo(path)
    return str(path)


CONFIG_CASES = [
    ("recent window 10**12", lambda p: '{"token_adaptive": true, "recent_tokens": 1000000000000}',
     "recent_tokens=1000000000000 is too large"),
    ("sink window 10**12", lambda p: '{"token_adaptive": true, "sink_tokens": 1000000000000}',
     "sink_tokens=1000000000000 is too large"),
    ("calibration tokens 10**12", lambda p: '{"calibration_tokens": 1000000000000}',
     "calibration_tokens=1000000000000 is too large"),
    ("ratio of 401 digits", lambda p: '{"rank_fraction": 1' + "0" * 400 + "}",
     "integer of 401 digits"),
    ("ratio 1e999", lambda p: '{"rank_fraction": 1e999}', "overflows a float"),
    ("ratio NaN", lambda p: '{"ratio": NaN}', "NaN, which is not a JSON number"),
    ("duplicate key", lambda p: '{"rank_fraction": 0.5, "rank_fraction": 0.9}', "key 'rank_fraction' twice"),
    ("binary file", _binary, "is not UTF-8 text"),
    ("nested 200,000 levels", _nested, "nests 200001 levels deep"),
    ("FIFO", _fifo, "is not a regular file"),
    ("directory", lambda p: str(p), "is a directory"),
    ("rank key 1_0", lambda p: '{"ranks": {"1_0": [64, 64]}}', "'1_0' is not a layer index"),
    ("rank key Arabic-Indic 3", lambda p: '{"ranks": {"\u0663": [64, 64]}}',
     "is not a layer index"),
    ("rank keys 3 and 03", lambda p: '{"ranks": {"3": [64, 64], "03": [32, 32]}}',
     "names layer 3 twice"),
]


@pytest.mark.parametrize("make,fragment", [c[1:] for c in CONFIG_CASES],
                         ids=[c[0] for c in CONFIG_CASES])
def test_config_flag_refusals(capsys, tmp_path, make, fragment):
    line = _refused(capsys, lambda: _config_flag(make(tmp_path)))
    assert fragment in line


def test_unreadable_config_file(capsys, tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    path.write_text('{"rank_fraction": 0.5}')
    real_open = os.open

    def denied(p, *a, **kw):
        if str(p) == str(path):
            raise PermissionError(13, "Permission denied")
        return real_open(p, *a, **kw)

    monkeypatch.setattr(os, "open", denied)
    assert "cannot be read (Permission denied)" in _refused(capsys, lambda: _config_flag(str(path)))


# ------------------------------------------------- against the model (front end)
ENGINE_CASES = [
    ("ratio 1e-9, default allocation", {"rank_fraction": 1e-9},
     "rank_fraction=1e-09 leaves 0 latent columns"),
    ("ratio 1e-9, artifact none", {"rank_fraction": 1e-9, "artifact": "none"}, "rounds to rank 0"),
    ("k_channel_tokens 48 at block 128",
     {"k_bits": 4, "token_adaptive": True, "k_quant": "channel", "k_channel_tokens": 48},
     "k_channel_tokens=48 must divide the KV block size 128"),
    ("recent window over max_model_len", {"token_adaptive": True, "recent_tokens": 100_000},
     f"recent_tokens=100000 exceeds the model's max_model_len {MAX_MODEL_LEN}"),
    ("sink window over max_model_len", {"token_adaptive": True, "sink_tokens": 4096},
     f"sink_tokens=4096 exceeds the model's max_model_len {MAX_MODEL_LEN}"),
]


@pytest.mark.parametrize("compression,fragment", [c[1:] for c in ENGINE_CASES],
                         ids=[c[0] for c in ENGINE_CASES])
def test_engine_config_refusals(capsys, model_path, compression, fragment):
    assert fragment in _refused(capsys, lambda: _engine_config(model_path, compression))


@pytest.mark.parametrize("compression,engine,expected", [
    ({}, {}, PREEMPTION_WATERMARK),                            # the mode's default
    ({"admission_watermark": 0}, {}, 0.0),                     # turned off
    ({"admission_watermark": 0.25}, {}, 0.25),
    ({"admission_watermark": 0.25}, {"watermark": 0.3}, 0.3),  # a nonzero --watermark wins
    ({"admission_watermark": 0}, {"watermark": 0.3}, 0.3),
])
def test_token_adaptive_admission_watermark(model_path, compression, engine, expected):
    """The scheduler's watermark in the engine config of a token-adaptive
    engine: 0.1 by default, the config's ``admission_watermark`` when given (an
    explicit ``--watermark 0`` cannot be told from vLLM's default 0), and a
    nonzero engine ``watermark`` over both."""
    from vllm.engine.arg_utils import EngineArgs

    patches.apply()
    args = EngineArgs(model=model_path, dtype="float32", max_model_len=MAX_MODEL_LEN, **engine,
                      additional_config={"kv_compression": {
                          "mode": "lowrank", "token_adaptive": True, "sink_tokens": 32,
                          "recent_tokens": 128, **compression}})
    assert args.create_engine_config().scheduler_config.watermark == expected


@pytest.mark.parametrize("compression,engine,expected", [
    ({"preset": "4x"}, {}, POST_ROPE_PREFILL_CHUNK_TOKENS),  # key codes read as stored
    ({"preset": "lossless"}, {}, POST_ROPE_PREFILL_CHUNK_TOKENS),
    ({"mode": "lowrank", "token_adaptive": True}, {}, PREFILL_CHUNK_TOKENS),  # keys rebuilt
    ({"preset": "4x"}, {"long_prefill_token_threshold": 512}, 512),  # the user's wins
    ({"preset": "4x"}, {"max_model_len": 1024}, 0),  # no cap above the model length
])
def test_token_adaptive_prefill_chunk(model_path, compression, engine, expected):
    """The per-request prefill chunk (``long_prefill_token_threshold``) a
    token-adaptive engine gets when none is given: 2,048 tokens where the
    history's keys are read as stored (``post_rope_keys``), 128 where every
    chunk rebuilds them, vLLM's own (0) when the model is shorter than the
    chunk."""
    from vllm.engine.arg_utils import EngineArgs

    patches.apply()
    args = EngineArgs(model=model_path, dtype="float32", **{"max_model_len": 4096, **engine},
                      additional_config={"kv_compression": {"mode": "lowrank", **compression}})
    got = args.create_engine_config().scheduler_config.long_prefill_token_threshold
    assert got == expected


# ------------------------------------------------------------------ artifacts
def _serving(**kw) -> dict:
    from vllm_lowrank.calibration.schema import SERVING_KEYS

    cfg = LowRankConfig(**kw)
    return {k: getattr(cfg, k) for k in SERVING_KEYS}


def smollm2_artifact(model_path: str) -> art.Artifact:
    """A byte-budget artifact for SmolLM2 (its geometry and fingerprint, random
    bases, 96/96 ranks at 8/8 bits in every layer)."""
    from transformers import AutoConfig

    from vllm_lowrank.factorization.bases import GroupBasis
    from vllm_lowrank.models.compression import manifest_shape, model_shapes

    hf = AutoConfig.from_pretrained(model_path)
    shape = model_shapes(hf, 1)[0]
    n = shape.kv_width
    g = torch.Generator().manual_seed(0)

    def basis():
        return GroupBasis(a=torch.randn(shape.hidden_size, n, generator=g),
                          b=torch.eye(n), energy=torch.linspace(2.0, 1.0, n))

    layers = hf.num_hidden_layers
    manifest = art.new_manifest(
        model_id="smollm2-random", architecture=hf.architectures[0],
        shape=manifest_shape(shape), num_layers=layers,
        fingerprint=art.checkpoint_fingerprint(model_path), method="fisher",
        group_size=shape.num_kv_heads, calibration={"text": "none"})
    manifest["ranks"] = {
        "ratio": None, "allocation": "bytes", "fixed": True,
        "layers": {str(i): [[96], [96]] for i in range(layers)},
        "bits": {str(i): [8, 8] for i in range(layers)},
        "serving": _serving(),
    }
    return art.Artifact(manifest, {i: ([basis()], [basis()]) for i in range(layers)})


@pytest.fixture(scope="module")
def valid_artifact(model_path, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("artifacts") / "valid")
    smollm2_artifact(model_path).save(path)
    return path


def _edit_manifest(edit):
    def apply(path):
        with open(os.path.join(path, art.MANIFEST)) as f:
            manifest = json.load(f)
        edit(manifest)
        with open(os.path.join(path, art.MANIFEST), "w") as f:
            json.dump(manifest, f)
    return apply


def _replace_manifest(make):
    def apply(path):
        target = os.path.join(path, art.MANIFEST)
        os.remove(target)
        make(target)
    return apply


def _edit_tensor(name, edit):
    def apply(path):
        from safetensors.torch import load_file, save_file

        target = os.path.join(path, art.TENSORS)
        tensors = load_file(target)
        edit(tensors[name])
        save_file(tensors, target)
    return apply


def _serving_edit(**changes):
    def edit(m):
        m["ranks"]["serving"].update(changes)
    return edit


def _pop(*keys):
    def edit(m):
        d = m
        for k in keys[:-1]:
            d = d[k]
        del d[keys[-1]]
    return edit


ARTIFACT_CASES = [
    ("manifest binary", _replace_manifest(lambda t: open(t, "wb").write(b"\x89PNG\x00\xff" * 64)),
     "is not UTF-8 text"),
    ("manifest a directory", _replace_manifest(os.mkdir), "is a directory"),
    ("manifest a FIFO", _replace_manifest(os.mkfifo), "is not a regular file"),
    ("manifest nested deep", _replace_manifest(
        lambda t: open(t, "w").write("[" * 200_000 + "]" * 200_000)), "nests 200000 levels"),
    ("serving ratio 5.0, recent -3", _edit_manifest(
        lambda m: m["ranks"].update(serving={"ratio": 5.0, "recent_tokens": -3})),
     "'ranks.serving.ratio' (not a serving setting"),
    ("serving recent -3", _edit_manifest(_serving_edit(recent_tokens=-3)),
     "'ranks.serving' (recent_tokens=-3 must be >= 1"),
    ("serving unknown key", _edit_manifest(_serving_edit(colour=1)),
     "'ranks.serving.colour' (not a serving setting"),
    ("serving missing", _edit_manifest(_pop("ranks", "serving")),
     "'ranks.serving' (must be an object"),
    ("bits [5, 5]", _edit_manifest(lambda m: m["ranks"]["bits"].update({"0": [5, 5]})),
     "'ranks.bits.0' (must be [k_bits, v_bits] from [16, 8, 4, 3, 2]"),
    ("fixed without layers", _edit_manifest(_pop("ranks", "layers")),
     "'ranks.layers' (is missing"),
    ("group_size 4", _edit_manifest(lambda m: m.update(group_size=4)),
     "'group_size' ((4) must divide model.num_kv_heads (3)"),
    ("rank key 1_0", _edit_manifest(
        lambda m: m["ranks"]["layers"].update({"1_0": m["ranks"]["layers"].pop("10")})),
     "key '1_0' is not a layer index"),
    ("rank key Arabic-Indic 3", _edit_manifest(
        lambda m: m["ranks"]["layers"].update({"\u0663": m["ranks"]["layers"].pop("3")})),
     "is not a layer index"),
    ("rank keys 3 and 03", _edit_manifest(
        lambda m: m["ranks"]["layers"].update({"03": m["ranks"]["layers"]["3"]})),
     "names layer 3 twice"),
    ("rank above the group width", _edit_manifest(
        lambda m: m["ranks"]["layers"].update({"0": [[999], [96]]})),
     "'ranks.layers.0.k' (must be an integer in 1..192"),
    ("NaN in a basis", _edit_tensor("l2.k0.a", lambda t: t.__setitem__((0, 0), float("nan"))),
     "tensor l2.k0.a has non-finite values"),
    ("NaN energy", _edit_tensor("l0.v0.e", lambda t: t.__setitem__(5, float("nan"))),
     "tensor l0.v0.e has non-finite values"),
    ("negative energy", _edit_tensor("l0.k0.e", lambda t: t.__setitem__(3, -1.0)),
     "tensor l0.k0.e has negative energies"),
]


@pytest.mark.parametrize("damage,fragment", [c[1:] for c in ARTIFACT_CASES],
                         ids=[c[0] for c in ARTIFACT_CASES])
def test_artifact_refusals(capsys, model_path, valid_artifact, tmp_path, damage, fragment):
    path = str(tmp_path / "artifact")
    shutil.copytree(valid_artifact, path)
    damage(path)
    line = _refused(capsys, lambda: _engine_config(model_path, {"artifact": path}))
    assert fragment in line


def test_valid_artifact_is_accepted(model_path, valid_artifact):
    _engine_config(model_path, {"artifact": valid_artifact})  # no SystemExit


def test_an_allocation_is_served_at_the_block_size_it_was_allocated_for(
        model_path, valid_artifact, tmp_path, caplog):
    """An allocation records the KV block size its exact tokens were rounded
    to (``budget.block_size``): an engine given no ``--block-size`` takes it,
    one given another keeps its own with a warning naming both; ``estimate``
    assumes what the engine takes."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_lowrank.calibration.allocate import allocated_block_size, default_block_size
    from vllm_lowrank.estimate import estimate
    from vllm_lowrank.presets import get_preset

    path = str(tmp_path / "allocated")
    shutil.copytree(valid_artifact, path)
    _edit_manifest(lambda m: m["ranks"].update(budget={"block_size": 64}))(path)
    assert allocated_block_size(path) == 64
    for other in (valid_artifact, "auto", "none", str(tmp_path / "missing")):
        assert allocated_block_size(other) is None  # no budget / not an allocation
    cfg = LowRankConfig.from_dict({"mode": "lowrank", "artifact": path})
    assert default_block_size(cfg) == (64, "artifact")
    four = LowRankConfig.from_dict({"mode": "lowrank", "preset": "4x"})
    assert default_block_size(four) == (get_preset("4x").block_size, "preset")
    assert default_block_size(LowRankConfig.from_dict(
        {"mode": "lowrank", "artifact": valid_artifact})) == (None, None)
    assert estimate(model_path, cfg)["block_size"] == 64  # what the engine takes
    assert estimate(model_path, cfg, block_size=16)["block_size"] == 16

    patches.apply()
    sizes = []
    log = logging.getLogger("vllm.lowrank")  # vLLM's loggers may not propagate to caplog's
    log.addHandler(caplog.handler)
    try:
        for given in (None, 16):
            args = EngineArgs(model=model_path, dtype="float32", max_model_len=MAX_MODEL_LEN,
                              block_size=given, additional_config={
                                  "kv_compression": {"mode": "lowrank", "artifact": path}})
            sizes.append(args.create_engine_config().cache_config.block_size)
    finally:
        log.removeHandler(caplog.handler)
    assert sizes == [64, 16]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("allocated for KV blocks of 64 tokens, served with 16" in w
               for w in warnings), warnings


# --------------------------------------------------------------- vllm-lowrank
CLI_CASES = [
    ("calibrate --tokens -5", lambda p: ["--tokens", "-5"], "--tokens -5 is out of range"),
    ("calibrate --tokens 10**12", lambda p: ["--tokens", str(10**12)],
     "--tokens 1000000000000 is out of range"),
    ("calibrate --text binary", lambda p: ["--text", _binary(p)], "is not UTF-8 text"),
    ("calibrate --text FIFO", lambda p: ["--text", _fifo(p)], "is not a regular file"),
]


@pytest.mark.parametrize("extra,fragment", [c[1:] for c in CLI_CASES],
                         ids=[c[0] for c in CLI_CASES])
def test_calibrate_refusals(capsys, tmp_path, extra, fragment):
    from vllm_lowrank.cli import main

    argv = ["calibrate", "smollm2-135m", "--output", str(tmp_path / "out"), *extra(tmp_path)]
    assert fragment in _refused(capsys, lambda: main(argv))


FORK_AFTER_CHECK = """
import os, sys, time, torch
torch.set_num_threads(2)  # a thread team to leave behind, on any machine
from vllm.engine.arg_utils import EngineArgs
from vllm_lowrank import patches
patches.apply()
EngineArgs(model=sys.argv[1], dtype="float32", max_model_len=512, additional_config={
    "kv_compression": {"mode": "lowrank", "artifact": sys.argv[2]}}).create_engine_config()
pid = os.fork()  # what vLLM does to start its engine core on CUDA (not on CPU: spawn)
if pid == 0:
    torch.randn(1 << 22).mul(2).abs().sum()  # a parallel region, as weight loading runs
    os._exit(0)
deadline = time.time() + 60
while time.time() < deadline:
    if os.waitpid(pid, os.WNOHANG)[0]:
        print("child done")
        break
    time.sleep(0.1)
else:
    os.kill(pid, 9)
    print("child hung")
"""


def test_an_engine_forked_after_the_artifact_check_runs_torch(model_path, valid_artifact):
    """The front-end's artifact check (loading every basis, fingerprinting the
    checkpoint) must not leave an OpenMP thread team behind: vLLM forks its
    engine core from the front end on CUDA, and GNU OpenMP is not fork-safe,
    so the worker's first parallel region (its weight loading) waited forever
    (an H200 engine with ``artifact: PATH`` never got past loading the model)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-P", "-c", FORK_AFTER_CHECK, model_path,
                           valid_artifact], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                               "OMP_NUM_THREADS": "2"})
    assert "child done" in proc.stdout, (proc.stdout[-2000:], proc.stderr[-3000:])
