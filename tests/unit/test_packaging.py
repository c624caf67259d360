"""Installation shape: the plugin entry point, and no top-level triton_kernels."""

import importlib.metadata as md
import os
import subprocess
import sys

import vllm_lowrank
from conftest import REPO


def test_general_plugin_entry_point():
    eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "lowrank"]
    assert eps and eps[0].value == "vllm_lowrank.plugin:register"


def test_triton_kernels_is_namespaced(tmp_path):
    # vLLM imports OpenAI's `triton_kernels`; ours must live under vllm_lowrank.
    code = ("import importlib.util, vllm_lowrank.triton_kernels as t;"
            "s = importlib.util.find_spec('triton_kernels');"
            "print(t.__name__, s.origin if s else None)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[0] == "vllm_lowrank.triton_kernels"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(vllm_lowrank.__file__)))
    assert out[1] == "None" or not os.path.abspath(out[1]).startswith(repo + os.sep)


def test_every_subpackage_is_installed():
    """pyproject's explicit package list names every sub-package of the source
    tree (a missing one installs in an editable checkout but not from a wheel or
    a Docker build)."""
    import tomllib

    root = REPO
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(p.parent.relative_to(root).parts)
             for p in (root / "vllm_lowrank").rglob("__init__.py")}
    assert found - {"vllm_lowrank"} and found <= listed, sorted(found - listed)
