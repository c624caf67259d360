"""Property-based tests (hypothesis) of input validation (issue 23): a valid
config or artifact manifest, mutated at random (a field deleted, replaced by
any JSON value, or an unknown field added), is either refused with one
:class:`LowRankConfigError` (one ``vllm-lowrank: error:`` line and exit 2 from
the command line) or accepted and served as recorded, never another
exception. No engine: the artifact is a tiny synthetic one and "served" means
its plans, slot layouts and byte counts are built as the worker builds them.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from conftest import save_tiny_artifact
from hypothesis import strategies as st
from test_validation import _config_flag, _refused, _serving

from vllm_lowrank.calibration import artifact as art
from vllm_lowrank.format.exact import exact_tokens
from vllm_lowrank.config import LowRankConfig, LowRankConfigError
from vllm_lowrank.factorization.plan import AttentionShape
from vllm_lowrank.models import compression as comp

SHAPE = AttentionShape(hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=4)
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(10**25), max_value=10**25)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
    | st.sampled_from(["token", "channel", "fisher", "svd", "03", "1_0", "\u0663"])
    | st.sampled_from([0, 1, 2, 3, 4, 8, 16, 32, 128, 0.5, 1.0]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=6)


def _paths(value, prefix=()):
    """Every key path into nested dicts and lists of ``value``."""
    items = (value.items() if isinstance(value, dict)
             else enumerate(value) if isinstance(value, list) else ())
    for key, child in items:
        yield prefix + (key,)
        yield from _paths(child, prefix + (key,))


@st.composite
def mutated(draw, valid: dict):
    """``valid`` with one random mutation."""
    value = json.loads(json.dumps(valid))
    paths = list(_paths(value))
    path = draw(st.sampled_from(paths))
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    op = draw(st.sampled_from(["replace", "delete", "add"]))
    if op == "replace" or (op == "delete" and isinstance(parent, list)):
        parent[path[-1]] = draw(JSON_VALUES)
    elif op == "delete":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[draw(st.text(min_size=1, max_size=6))] = draw(JSON_VALUES)
    else:
        parent.append(draw(JSON_VALUES))
    return value


VALID_CONFIG = {"rank_fraction": 0.5, "head_group_size": 1, "ranks": {"0": [8, 8]}, "method": "fisher",
                "rank_allocation": "fisher", "artifact": "auto", "calibration_tokens": 4096,
                "k_bits": 4, "v_bits": 4, "quant_group_size": 8, "hadamard": True,
                "token_adaptive": True, "sink_tokens": 4, "recent_tokens": 128,
                "exact_bits": 8, "k_quant": "channel", "k_channel_tokens": 32}


def test_valid_config_is_valid():
    LowRankConfig.from_dict({"mode": "lowrank", **VALID_CONFIG})


@SETTINGS
@given(raw=mutated(VALID_CONFIG))
def test_mutated_config_is_refused_cleanly_or_accepted(capsys, raw):
    text = json.dumps(raw)  # NaN/Infinity written as such: the parser must refuse them
    try:
        cfg = LowRankConfig.from_dict({"mode": "lowrank", **json.loads(text)})
    except LowRankConfigError:
        cfg = None
    if cfg is None or not all(math.isfinite(x) for x in _numbers(raw)):
        _refused(capsys, lambda: _config_flag(text))
    else:
        _config_flag(text)  # accepted from the command line as well
        assert cfg.to_dict()["rank_fraction"] == cfg.rank_fraction


def _numbers(value):
    if isinstance(value, float):
        yield value
    for child in (value.values() if isinstance(value, dict)
                  else value if isinstance(value, list) else ()):
        yield from _numbers(child)


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory) -> str:
    """Two layers of ``SHAPE``, one head group, a fixed byte-budget allocation."""
    return save_tiny_artifact(
        str(tmp_path_factory.mktemp("tiny") / "artifact"), SHAPE,
        {"ratio": None, "allocation": "bytes", "fixed": True,
         "layers": {"0": [[8], [8]], "1": [[8], [8]]},
         "bits": {"0": [8, 8], "1": [4, 4]}, "serving": _serving()})


def _serve(path: str) -> dict:
    """What the worker builds from the artifact at ``path`` (no model needed)."""
    artifact = art.load_artifact(path)
    cfg = LowRankConfig(mode="lowrank", artifact=path)
    cfg, bits = comp.allocation_settings(cfg, artifact, path)
    shapes = {i: SHAPE for i in range(artifact.manifest["model"]["num_layers"])}
    plans = comp.allocate(cfg, shapes, artifact, per_layer=cfg.token_adaptive)
    exact = exact_tokens(cfg, 32)
    compression = comp.ModelCompression(cfg=cfg, plans=plans, artifact=artifact,
                                        artifact_path=path, exact_tokens=exact, bits=bits,
                                        one_page=cfg.token_adaptive)
    return compression.summary(2)


def test_tiny_artifact_is_served_compressed(tiny_artifact):
    summary = _serve(tiny_artifact)
    assert summary["layers"][1]["bits"] == [4, 4]
    assert summary["compression_ratio"] > 1.5


@SETTINGS
@given(data=st.data())
def test_mutated_manifest_is_refused_cleanly_or_served_as_recorded(tiny_artifact, tmp_path,
                                                                    data):
    with open(os.path.join(tiny_artifact, art.MANIFEST)) as f:
        valid = json.load(f)
    manifest = data.draw(mutated(valid))
    path = str(tmp_path / f"a{data.draw(st.integers(0, 10**9))}")
    shutil.copytree(tiny_artifact, path)
    with open(os.path.join(path, art.MANIFEST), "w") as f:
        json.dump(manifest, f)
    try:
        summary = _serve(path)
    except LowRankConfigError as e:
        assert "\n" not in str(e)
        return
    finally:
        shutil.rmtree(path)
    recorded = manifest["ranks"]
    if recorded and recorded.get("fixed"):  # served exactly as recorded
        for layer, (k, v) in recorded["layers"].items():
            assert summary["layers"][int(layer)]["k_ranks"] == k
            assert summary["layers"][int(layer)]["v_ranks"] == v
        if "bits" in recorded:
            for layer, b in recorded["bits"].items():
                assert summary["layers"][int(layer)]["bits"] == b
