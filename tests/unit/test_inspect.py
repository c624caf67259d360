"""``vllm-lowrank inspect``: what an artifact holds, from the manifest alone,
with bytes per token counted independently here."""

from __future__ import annotations

import json

import pytest
from conftest import save_tiny_artifact

from vllm_lowrank import cli
from vllm_lowrank.calibration import artifact as art
from vllm_lowrank.factorization.plan import AttentionShape

SHAPE = AttentionShape(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16)


def _artifact(tmp_path, ranks=None) -> str:
    return save_tiny_artifact(str(tmp_path / "artifact"), SHAPE, ranks)


def _serving(**kw):
    from vllm_lowrank.calibration.schema import SERVING_KEYS
    from vllm_lowrank.config import LowRankConfig

    cfg = LowRankConfig(**kw)
    return {k: getattr(cfg, k) for k in SERVING_KEYS}


def test_allocation_is_described_with_its_bytes(tmp_path, capsys):
    path = _artifact(tmp_path, {"ratio": None, "allocation": "bytes", "fixed": True,
                                "layers": {"0": [[16], [8]], "1": [[8], [24]]},
                                "bits": {"0": [8, 4], "1": [16, 16]},
                                "serving": _serving()})
    cli.main(["inspect", path, "--json"])
    info = json.loads(capsys.readouterr().out)
    assert info["model"]["id"] == "tiny" and info["method"] == "fisher"
    assert info["digest"] == art.load_artifact(path).digest
    assert info["layers"]["0"] == {"k_ranks": [16], "v_ranks": [8], "k_bits": 8, "v_bits": 4}
    # layer 0: 16 one-byte K codes + 8 half-byte V codes + a float16 scale and zero per
    # side; layer 1: 16-bit latents, 2 bytes per channel
    assert info["latent_bytes_per_token"] == (16 + 4 + 2 * 2 * 2) + 2 * (8 + 24)
    assert info["bf16_kv_bytes_per_token"] == 2 * 2 * 2 * 2 * 16
    assert info["compression"] == pytest.approx(256 / 92)

    cli.main(["inspect", path])
    text = capsys.readouterr().out
    assert "2.78x" in text and "| 1 | [8] | [24] | 16 | 16 |" in text


def test_calibration_only_artifact_has_no_fixed_ranks(tmp_path, capsys):
    cli.main(["inspect", _artifact(tmp_path), "--json"])
    assert json.loads(capsys.readouterr().out)["ranks"] is None
    cli.main(["inspect", _artifact(tmp_path)])
    assert "chosen at serve time" in capsys.readouterr().out


def test_not_an_artifact_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["inspect", str(tmp_path / "missing")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vllm-lowrank: error:") and "\n" not in err
