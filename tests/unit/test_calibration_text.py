"""``calibration_text``: which built-in text ``artifact: "auto"`` calibrates on
(:func:`vllm_lowrank.calibration.cache.load_or_calibrate`) and a preset's
allocation measures on (:func:`~vllm_lowrank.calibration.cache.load_or_allocate`),
and where each is cached."""

from __future__ import annotations

import typing

import pytest

from vllm_lowrank.calibration import cache
from vllm_lowrank.calibration import text as texts
from vllm_lowrank.config import CalibrationText, LowRankConfig, LowRankConfigError


def test_the_config_names_every_built_in_text():
    assert set(typing.get_args(CalibrationText)) == set(texts.CALIBRATION_TEXTS)
    assert LowRankConfig.calibration_text == texts.DEFAULT_CALIBRATION_TEXT


def test_an_unknown_text_is_refused_naming_the_choices():
    with pytest.raises(LowRankConfigError, match="calibration_text") as e:
        LowRankConfig.from_dict({"mode": "lowrank", "calibration_text": "code"})
    assert "wikipedia" in str(e.value) and "mix" in str(e.value)


def test_each_text_is_cached_apart(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_LOWRANK_CACHE", str(tmp_path))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    base = {"mode": "lowrank", "rank_fraction": 0.5}  # a calibrated setting
    wiki = LowRankConfig.from_dict(base)
    mix = LowRankConfig.from_dict({**base, "calibration_text": "mix"})
    explicit = LowRankConfig.from_dict({**base, "calibration_text": "wikipedia"})
    paths = {cache.auto_artifact_path(str(model), c) for c in (wiki, mix)}
    assert len(paths) == 2
    # naming the default text is the default artifact (earlier caches stay valid)
    assert cache.auto_artifact_path(str(model), explicit) == \
        cache.auto_artifact_path(str(model), wiki)


class _Stop(Exception):
    pass


@pytest.mark.parametrize("name", sorted(texts.CALIBRATION_TEXTS))
def test_auto_calibration_reads_the_configured_text(name, tmp_path, monkeypatch):
    """The documents handed to the calibration are the named built-in text's,
    and the manifest's description names it."""
    from vllm_lowrank.calibration import calibrate

    monkeypatch.setenv("VLLM_LOWRANK_CACHE", str(tmp_path))
    model = tmp_path / "model"
    model.mkdir()
    seen = {}

    def fake(model_path, **kw):
        seen.update(kw)
        raise _Stop

    monkeypatch.setattr(calibrate, "calibrate_model", fake)
    cfg = LowRankConfig.from_dict({"mode": "lowrank", "calibration_text": name,
                                   "calibration_tokens": 4096})
    with pytest.raises(_Stop):
        cache.load_or_calibrate(str(model), cfg)
    assert seen["documents"] == texts.calibration_documents(name)
    assert seen["text_description"] == texts.CALIBRATION_TEXTS[name]
    assert seen["num_tokens"] == 4096


def test_a_preset_allocation_measures_on_the_configured_text(tmp_path, monkeypatch):
    from vllm_lowrank.calibration import allocate

    seen = {}

    def fake(model_path, artifact, cfg, **kw):
        seen.update(kw)
        raise _Stop

    monkeypatch.setattr(allocate, "budget_artifact", fake)
    cfg = LowRankConfig.from_dict({"mode": "lowrank", "preset": "8x"})
    with pytest.raises(_Stop):
        cache.load_or_allocate(str(tmp_path / "model"), cfg, None, str(tmp_path / "base"), 32)
    assert seen["documents"] == texts.calibration_documents(cfg.calibration_text)
