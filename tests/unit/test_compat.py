"""The vLLM internals behind ``vllm_lowrank/compat.py`` exist in the installed
vLLM and behave as the plugin needs; the version gate of ``plugin.register``."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from vllm_lowrank import compat


def test_installed_vllm_is_supported():
    assert compat.unsupported_vllm() is None


@pytest.mark.parametrize("version,ok", [("0.32.0", True), ("0.32.3+cpu", True),
                                        ("0.33.0", False), ("0.3.2", False),
                                        ("1.32.0", False), ("unknown", False)])
def test_version_gate(version, ok):
    why = compat.unsupported_vllm(version)
    assert (why is None) == ok
    if not ok:
        assert version in why and "0.32" in why and "\n" not in why


def test_register_refuses_another_vllm_series(monkeypatch, caplog):
    """On an unsupported vLLM nothing is registered (stock vLLM keeps working)
    and one error line says why."""
    from vllm_lowrank import patches, plugin

    monkeypatch.setattr(compat, "unsupported_vllm", lambda: "vllm-lowrank supports 0.32.x")
    called = []
    monkeypatch.setattr(patches, "apply", lambda: called.append("patches"))
    with caplog.at_level(logging.ERROR, logger="vllm.lowrank"):
        plugin.register()
    assert not called
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == \
        ["vllm-lowrank supports 0.32.x"]


def test_encode_layer_name_is_what_the_attention_ops_take():
    from vllm.utils.torch_utils import _encode_layer_name

    assert compat.encode_layer_name("model.layers.0.self_attn.attn") == \
        _encode_layer_name("model.layers.0.self_attn.attn")


def test_rotary_cos_sin_matches_the_registered_cache():
    """The recomputed table equals the module's own buffer (float32 model),
    for plain and scaled RoPE."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        _check_rotary(get_rope)


def _check_rotary(get_rope):
    for scaling in (None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 1024}):
        params = {"rope_theta": 500000.0, **({"rope_type": "default"} if scaling is None
                                              else scaling)}
        rotary = get_rope(64, max_position=2048, is_neox_style=True, rope_parameters=params,
                          dtype=torch.float32)
        table = compat.rotary_cos_sin(rotary)
        assert table.shape == (2048, 64)
        torch.testing.assert_close(table.float(), rotary.cos_sin_cache.float())


def test_register_kv_cache_spec_keeps_vllms_own_specs():
    from vllm.v1 import kv_cache_spec_registry as reg
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from vllm_lowrank.attention import exact_cache

    exact_cache.register_spec()
    registered = reg._REGISTRY_KVCACHESPEC_LIST
    for spec in (FullAttentionSpec, SlidingWindowSpec, exact_cache.ExactTokensSpec):
        assert spec in registered, spec.__name__
    assert registered[exact_cache.ExactTokensSpec].manager_class.__name__ == \
        "ExactTokensManager"


def test_argument_group_titles():
    parser = argparse.ArgumentParser()
    parser.add_argument_group(title="KVCompression")
    assert "KVCompression" in compat.argument_group_titles(parser)


def _private_names(root) -> set[str]:
    """Names with one leading underscore that the Python sources under ``root``
    define: functions, methods, classes, and attributes or variables they assign."""
    import ast

    names = set()
    for path in root.rglob("*.py"):
        try:
            tree = ast.parse(path.read_text(errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = node.name
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                name = node.attr
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                name = node.id
            else:
                continue
            if name.startswith("_") and not name.startswith("__"):
                names.add(name)
    return names


def _private_uses(path) -> list[tuple[int, str]]:
    """``(line, name)`` of every private attribute a module reads or calls
    (``x._name``) and every private name it imports from vLLM."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm."):
            out += [(node.lineno, a.name) for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    return out


OTHER_LIBRARIES = {"_attn_implementation": "transformers' PretrainedConfig (calibration)"}
"""Private names of other libraries that vLLM's sources happen to define too."""


def test_only_compat_touches_vllm_private_names():
    """Every vLLM internal the plugin uses goes through ``compat.py``: no other
    module reads, calls or imports a private name that vLLM defines (and this
    package does not define itself; :data:`OTHER_LIBRARIES` aside). Static:
    nothing is imported."""
    import pathlib

    import vllm

    import vllm_lowrank

    ours_root = pathlib.Path(vllm_lowrank.__file__).parent
    theirs = (_private_names(pathlib.Path(vllm.__file__).parent) - _private_names(ours_root)
              - set(OTHER_LIBRARIES))
    found = [f"{path.relative_to(ours_root)}:{line}: {name}"
             for path in sorted(ours_root.rglob("*.py")) if path.name != "compat.py"
             for line, name in _private_uses(path) if name in theirs]
    assert not found, "vLLM private names outside compat.py:\n" + "\n".join(found)


def test_the_private_name_check_sees_a_use(tmp_path):
    """The scan finds a planted call of a vLLM private method."""
    planted = tmp_path / "m.py"
    planted.write_text("def f(m):\n    return m._remove_blocks_in_range(1, 2, 3)\n")
    assert _private_uses(planted) == [(2, "_remove_blocks_in_range")]
