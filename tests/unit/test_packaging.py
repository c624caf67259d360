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
    data = _setuptools()["package-data"]["vllm_lowrank.kernels.cuda"]
    assert data == ["*.cu", "*.cuh"]
    here = REPO / "vllm_lowrank" / "kernels" / "cuda"
    assert list(here.glob("*.cu"))
    # every header a source includes travels with it
    for src in here.glob("*.cu"):
        for line in src.read_text().splitlines():
            if line.startswith('#include "'):
                assert (here / line.split('"')[1]).exists(), (src.name, line)
