"""``vllm-lowrank-serve`` (the image's entry point) starts ``vllm serve`` only
with an API key (issue 23: closed by default)."""

from __future__ import annotations

import pytest
from conftest import REPO

from vllm_lowrank import serve_entry
from vllm_lowrank.config import LowRankConfigError

ARGS = ["MODEL", "--host", "0.0.0.0"]


def test_key_file_becomes_the_environment_key(tmp_path):
    key = tmp_path / "api-key"
    key.write_text("s3cret\n")
    command, env = serve_entry.serve_command(ARGS, {"VLLM_API_KEY_FILE": str(key)})
    assert command == ["vllm", "serve", *ARGS]
    assert env["VLLM_API_KEY"] == "s3cret"
    assert "s3cret" not in " ".join(command)


@pytest.mark.parametrize("argv,env", [
    (ARGS + ["--api-key", "k"], {}),
    (ARGS + ["--api-key=k"], {}),
    (ARGS, {"VLLM_API_KEY": "k"}),
    (ARGS, {"VLLM_LOWRANK_ALLOW_NO_API_KEY": "1"}),
])
def test_other_ways_to_start(argv, env):
    assert serve_entry.serve_command(argv, env)[0] == ["vllm", "serve", *argv]


def test_refuses_without_a_key(tmp_path, capsys, monkeypatch):
    with pytest.raises(LowRankConfigError, match="no API key"):
        serve_entry.serve_command(ARGS, {"VLLM_API_KEY": ""})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(LowRankConfigError, match="is empty"):
        serve_entry.serve_command(ARGS, {"VLLM_API_KEY_FILE": str(empty)})
    with pytest.raises(LowRankConfigError, match="does not exist"):
        serve_entry.serve_command(ARGS, {"VLLM_API_KEY_FILE": str(tmp_path / "missing")})
    for name in ("VLLM_API_KEY", "VLLM_API_KEY_FILE", "VLLM_LOWRANK_ALLOW_NO_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        serve_entry.main(ARGS)  # refused before exec
    assert info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("vllm-lowrank: error: no API key")


def test_console_script_is_the_image_entry_point():
    import re
    import tomllib

    root = REPO
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["vllm-lowrank-serve"] == "vllm_lowrank.serve_entry:main"
    dockerfile = (root / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["vllm-lowrank-serve"\]$', dockerfile, re.M)
