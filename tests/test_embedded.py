"""The embedded-model cache: reuse when complete, rebuild when damaged."""

import json
import os

from vllm_lowrank import embedded


def _fake_conversion(folder):
    os.makedirs(folder)
    for name, data in (("config.json", b"{}"), ("model.safetensors", b"x" * 1000)):
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
    with open(os.path.join(folder, embedded.MARKER), "w") as f:
        json.dump({"files": embedded._folder_manifest(folder)}, f)


def test_complete_folder_is_trusted(tmp_path):
    folder = str(tmp_path / "m")
    _fake_conversion(folder)
    assert embedded.is_complete(folder)


def test_partial_or_corrupt_folder_is_detected(tmp_path):
    folder = str(tmp_path / "m")
    _fake_conversion(folder)
    path = os.path.join(folder, "model.safetensors")
    with open(path, "r+b") as f:  # same size, one byte flipped
        f.write(b"y")
    assert not embedded.is_complete(folder)
    _fake_conversion(str(tmp_path / "n"))
    with open(os.path.join(tmp_path / "n", "model.safetensors"), "ab") as f:
        f.truncate(10)
    assert not embedded.is_complete(str(tmp_path / "n"))
    os.makedirs(tmp_path / "o")  # conversion interrupted before the marker
    assert not embedded.is_complete(str(tmp_path / "o"))


def test_prepare_rebuilds_a_corrupt_cache(tmp_path, monkeypatch):
    calls = []

    def convert(model, out_dir):
        calls.append(out_dir)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write("{}")

    monkeypatch.setattr(embedded, "_convert", convert)
    path = embedded.prepare(cache_dir=str(tmp_path))
    assert embedded.is_complete(path) and len(calls) == 1
    assert embedded.prepare(cache_dir=str(tmp_path)) == path and len(calls) == 1
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write('{"broken": true}')
    assert embedded.prepare(cache_dir=str(tmp_path)) == path and len(calls) == 2
    assert embedded.is_complete(path)
