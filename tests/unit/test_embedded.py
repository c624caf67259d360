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
        json.dump({"files": embedded.folder_manifest(folder)}, f)


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

    def convert(model, out_dir, work_dir):
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


def test_gemma_tokenizer_adds_bos_and_windows_start_with_it():
    """Gemma-3 was trained with a BOS token in front of every sequence; the
    converted tokenizer adds it, and evaluation windows built from raw ids
    (:func:`token_windows`) start with it. SmolLM2's tokenizer adds none."""
    from transformers import AutoTokenizer

    from vllm_lowrank.calibration.text import adds_bos, token_windows

    gemma = AutoTokenizer.from_pretrained(embedded.prepare("gemma3-270m"))
    smol = AutoTokenizer.from_pretrained(embedded.prepare("smollm2-135m"))
    assert gemma("hi").input_ids[0] == gemma.bos_token_id and adds_bos(gemma)
    assert not adds_bos(smol)
    docs = ["One two three four five six seven eight nine ten. " * 20]
    windows = token_windows(gemma, docs, 2, 16)
    assert all(w[0] == gemma.bos_token_id and len(w) == 16 for w in windows)
    assert all(w[0] != smol.bos_token_id for w in token_windows(smol, docs, 2, 16))
