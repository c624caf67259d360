"""Installation shape: the plugin entry point, every sub-package installed, the
CUDA sources shipped as package data."""

import importlib.metadata as md
import tomllib

from conftest import REPO


def test_general_plugin_entry_point():
    eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "lowrank"]
    assert eps and eps[0].value == "vllm_lowrank.plugin:register"


def _setuptools() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_subpackage_is_installed():
    """Packages are found, not listed or mapped (no ``package-dir`` alias), and
    every folder of the source tree that holds Python modules is a package that
    the finder installs (a folder without ``__init__.py`` works in an editable
    checkout but is missing from a wheel or a Docker build)."""
    from setuptools import find_packages

    cfg = _setuptools()
    assert "package-dir" not in cfg
    assert cfg["packages"] == {"find": {"include": ["vllm_lowrank*"]}}
    found = set(find_packages(str(REPO), include=["vllm_lowrank*"]))
    folders = {".".join(p.parent.relative_to(REPO).parts)
               for p in (REPO / "vllm_lowrank").rglob("*.py")}
    assert "vllm_lowrank.kernels.triton" in folders
    assert folders <= found, sorted(folders - found)


def test_cuda_sources_are_package_data():
    import fnmatch

    from vllm_lowrank.kernels.cuda import ext

    data = _setuptools()["package-data"]["vllm_lowrank.kernels.cuda"]
    assert data == ["*.cu", "*.cuh", "*.h", "*.cpp"]
    here = REPO / "vllm_lowrank" / "kernels" / "cuda"
    sources = [name for names in ext.MODULES.values() for name in names]
    assert sources
    # every module's sources, and every header a source includes, travel with it
    for name in sources:
        assert (here / name).exists(), name
        assert any(fnmatch.fnmatch(name, pat) for pat in data), (name, data)
        for line in (here / name).read_text().splitlines():
            if line.startswith('#include "'):
                header = line.split('"')[1]
                assert (here / header).exists(), (name, line)
                assert any(fnmatch.fnmatch(header, pat) for pat in data), (header, data)
