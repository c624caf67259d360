"""Presets (:mod:`vllm_lowrank.presets`): ``{"preset": NAME}`` fills the keys the
user did not give, every preset is a valid config, and the README's table names
each one with its measured figures."""

from __future__ import annotations


import pytest
from conftest import REPO

from vllm_lowrank.config import LowRankConfig, LowRankConfigError
from vllm_lowrank.presets import PRESETS

ROOT = REPO


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_a_valid_config_with_its_settings(name):
    cfg = LowRankConfig.from_dict({"mode": "lowrank", "preset": name})
    assert cfg.preset == name
    for key, value in PRESETS[name].settings.items():
        assert getattr(cfg, key) == value, key
    # the preset's keys are not the user's: an allocation may replace them
    assert cfg.explicit == {"mode", "preset"}


def test_keys_beside_a_preset_override_it_and_count_as_given():
    cfg = LowRankConfig.from_dict({"mode": "lowrank", "preset": "4x", "recent_tokens": 64,
                                   "v_bits": 8})
    assert (cfg.recent_tokens, cfg.v_bits, cfg.k_bits, cfg.rank_fraction) == (64, 8, 4, 1.0)
    assert {"recent_tokens", "v_bits"} <= cfg.explicit
    assert "k_bits" not in cfg.explicit


def test_an_override_is_validated_with_the_preset():
    # per-channel keys (the 4x preset) need quantized keys
    with pytest.raises(LowRankConfigError, match="k_quant=\"channel\""):
        LowRankConfig.from_dict({"mode": "lowrank", "preset": "4x", "k_bits": 16})


@pytest.mark.parametrize("bad", ["9x", "", 8, "8X", ["4x"]])
def test_unknown_preset_is_refused_naming_the_presets(bad):
    with pytest.raises(LowRankConfigError, match="not a preset.*'2x', '4x', '8x', 'lossless'"):
        LowRankConfig.from_dict({"mode": "lowrank", "preset": bad})


def test_null_preset_is_no_preset():
    assert LowRankConfig.from_dict({"mode": "lowrank", "preset": None}) == \
        LowRankConfig(mode="lowrank")


@pytest.mark.parametrize("key,value", [("rank_fraction", 0.5), ("k_bits", 8), ("v_bits", 4),
                                       ("ranks", {"0": [64, 64]}), ("artifact", "/tmp/x"),
                                       ("rank_allocation", "uniform"), ("method", "svd")])
def test_allocation_preset_refuses_what_its_allocation_chooses(key, value):
    with pytest.raises(LowRankConfigError, match=f"allocates ranks and bits.*{key}"):
        LowRankConfig.from_dict({"mode": "lowrank", "preset": "8x", key: value})


def test_a_preset_survives_the_trip_through_additional_config():
    from vllm_lowrank.config import config_from_additional

    cfg = LowRankConfig.from_dict({"mode": "lowrank", "preset": "lossless"})
    again = config_from_additional({"kv_compression": cfg.to_dict()})
    assert again == cfg


def test_readme_table_lists_every_preset_with_its_measured_compression():
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Which setting", 1)[1].split("\n## ", 1)[0]
    for name, preset in PRESETS.items():
        row = next((line for line in table.splitlines() if line.startswith(f"| `{name}`")),
                   None)
        assert row is not None, f"README 'Which setting' has no row for preset {name}"
        assert preset.measured.split(",")[0] in row, (name, row)


@pytest.mark.parametrize("additional", [{"kv_compression": "lowrank"},
                                        {"kv_compression": {"mode": "lowrank"}}])
def test_lowrank_without_settings_takes_the_default_preset(additional):
    from vllm_lowrank.config import config_from_additional
    from vllm_lowrank.presets import DEFAULT_PRESET, PRESETS

    cfg = config_from_additional(additional)
    assert cfg.enabled and cfg.preset == DEFAULT_PRESET
    for key, value in PRESETS[DEFAULT_PRESET].settings.items():
        assert getattr(cfg, key) == value, key


def test_any_setting_turns_the_default_preset_off():
    from vllm_lowrank.config import config_from_additional

    cfg = config_from_additional({"kv_compression": {"mode": "lowrank", "rank_fraction": 0.5}})
    assert cfg.preset is None and cfg.rank_fraction == 0.5 and cfg.k_bits == 16
    assert not config_from_additional({"kv_compression": "none"}).enabled
