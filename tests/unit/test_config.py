"""Config parsing and validation, and the CLI merge into additional_config."""

import json

import pytest
from conftest import REPO

from vllm_lowrank.config import (
    LowRankConfig,
    LowRankConfigError,
    config_from_additional,
    parse_config_text,
)
from vllm_lowrank.patches import merge_cli_settings


def test_defaults_are_off_and_valid():
    cfg = config_from_additional({})
    assert not cfg.enabled
    cfg.validate()


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.0001, 2])
def test_rank_fraction_out_of_range_is_refused(fraction):
    with pytest.raises(LowRankConfigError, match=f"rank_fraction={float(fraction)} is out"):
        LowRankConfig.from_dict({"mode": "lowrank", "rank_fraction": fraction})


def test_rank_fraction_bounds_accepted():
    for fraction in (1.0, 0.01):
        cfg = LowRankConfig.from_dict({"mode": "lowrank", "rank_fraction": fraction})
        assert cfg.rank_fraction == fraction


def test_deprecated_keys_are_read_with_a_warning(caplog):
    """``ratio`` and ``group_size`` (earlier names) mean ``rank_fraction`` and
    ``head_group_size``, warn once each, count as set explicitly, and never
    appear in the dict that travels to vLLM's workers; both names at once are
    refused."""
    with pytest.warns(FutureWarning) as record, \
            caplog.at_level("WARNING", logger="vllm.lowrank"):
        cfg = LowRankConfig.from_dict({"mode": "lowrank", "ratio": 0.25, "group_size": 1})
    messages = [str(w.message) for w in record]
    assert len(messages) == 2
    assert "'ratio' is deprecated" in messages[0] and "use 'rank_fraction'" in messages[0]
    assert "'group_size' is deprecated" in messages[1]
    assert (cfg.rank_fraction, cfg.head_group_size) == (0.25, 1)
    assert {"rank_fraction", "head_group_size"} <= cfg.explicit
    assert "'group_size' is deprecated" in caplog.text
    d = cfg.to_dict()
    assert "ratio" not in d and "group_size" not in d and d["rank_fraction"] == 0.25
    with pytest.raises(LowRankConfigError, match="both 'ratio' and 'rank_fraction'"):
        LowRankConfig.from_dict({"mode": "lowrank", "ratio": 0.5, "rank_fraction": 0.5})
    with pytest.raises(LowRankConfigError, match="rank_fraction=2.0 is out of range"), \
            pytest.warns(FutureWarning):
        LowRankConfig.from_dict({"mode": "lowrank", "ratio": 2.0})


@pytest.mark.parametrize("argv,dest,value,old,new", [
    (["calibrate", "m", "--output", "o", "--ratio", "0.3"], "rank_fraction", 0.3,
     "--ratio", "--rank-fraction"),
    (["calibrate", "m", "--output", "o", "--group-size", "2"], "head_group_size", 2,
     "--group-size", "--head-group-size"),
    (["allocate", "m", "--output", "o", "--ratio", "8"], "compression", 8.0,
     "--ratio", "--compression"),
])
def test_deprecated_cli_flags_warn(capsys, argv, dest, value, old, new):
    from vllm_lowrank.cli import build_parser

    args = build_parser().parse_args(argv)
    assert getattr(args, dest) == value
    assert f"{old} is deprecated" in capsys.readouterr().err
    args = build_parser().parse_args([*argv[:-2], new, argv[-1]])
    assert getattr(args, dest) == value
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("raw,fragment", [
    ({"rank_fraction": "half"}, "rank_fraction must be a number"),
    ({"head_group_size": 0}, "head_group_size=0 must be >= 1"),
    ({"method": "magic"}, "method"),
    ({"rank_allocation": "fisher", "method": "svd"}, "rank_allocation"),
    ({"colour": 1}, "unknown --kv-compression-config key"),
    ({"ranks": {"x": [8, 8]}}, "not a layer index"),
    ({"ranks": {"0": [8]}}, "pair of integers"),
    ({"token_adaptive": "yes"}, "token_adaptive must be true or false"),
    ({"token_adaptive": True, "sink_tokens": -1}, "sink_tokens=-1 must be >= 0"),
    ({"token_adaptive": True, "recent_tokens": 0}, "recent_tokens=0 must be >= 1"),
    ({"token_adaptive": True, "method": "post_rope", "head_group_size": 1,
      "rank_allocation": "energy"}, "token_adaptive is not supported with method"),
    ({"k_quant": "block"}, "k_quant='block' is not supported"),
    ({"k_quant": "channel", "k_bits": 4}, "needs k_bits < 16 and token_adaptive"),
    ({"k_quant": "channel", "token_adaptive": True}, "needs k_bits < 16 and token_adaptive"),
    ({"k_channel_tokens": 0}, "k_channel_tokens=0 must be >= 1"),
    ({"admission_watermark": 0.1}, "add \"token_adaptive\": true or drop it"),
    ({"token_adaptive": True, "admission_watermark": -0.1}, "0 <= admission_watermark < 1"),
    ({"token_adaptive": True, "admission_watermark": 1}, "it must be below 1.0"),
    ({"token_adaptive": True, "admission_watermark": "0.1"}, "must be a number"),
])
def test_bad_values_name_the_problem(raw, fragment):
    with pytest.raises(LowRankConfigError, match=fragment):
        LowRankConfig.from_dict({"mode": "lowrank", **raw})


def test_parse_inline_and_file(tmp_path):
    assert parse_config_text('{"rank_fraction": 0.25}') == {"rank_fraction": 0.25}
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"rank_fraction": 0.75, "head_group_size": 1}))
    assert parse_config_text(str(f)) == {"rank_fraction": 0.75, "head_group_size": 1}


@pytest.mark.parametrize("text,fragment", [
    ('{"rank_fraction": 0.5', "malformed JSON"),
    ("[1, 2]", "neither inline JSON"),
    ("/no/such/file.json", "neither inline JSON"),
])
def test_malformed_config_text(text, fragment):
    with pytest.raises(LowRankConfigError, match=fragment):
        parse_config_text(text)


def test_cli_flags_merge_after_additional_config():
    # --additional-config given with other keys and its own kv_compression entry:
    # the dedicated flags win, other keys survive.
    merged = merge_cli_settings(
        {"other": 1, "kv_compression": {"rank_fraction": 0.9, "head_group_size": 1}},
        "lowrank", {"rank_fraction": 0.25})
    assert merged["other"] == 1
    assert merged["kv_compression"] == {"rank_fraction": 0.25, "head_group_size": 1, "mode": "lowrank"}
    assert config_from_additional(merged).rank_fraction == 0.25


def test_config_without_mode_is_refused():
    with pytest.raises(LowRankConfigError, match="--kv-compression lowrank"):
        merge_cli_settings({}, None, {"rank_fraction": 0.5})


def test_string_shorthand_in_additional_config():
    assert config_from_additional({"kv_compression": "lowrank"}).enabled
    with pytest.raises(LowRankConfigError):
        config_from_additional({"kv_compression": "zip"})


def test_channel_group_must_divide_the_block():
    from vllm_lowrank.format.exact import exact_tokens

    cfg = LowRankConfig.from_dict({"mode": "lowrank", "k_bits": 4, "token_adaptive": True,
                                   "k_quant": "channel", "k_channel_tokens": 48})
    with pytest.raises(LowRankConfigError, match="k_channel_tokens=48 must divide the KV block"):
        exact_tokens(cfg, 32)
    exact = exact_tokens(cfg, 96)
    assert (exact.sink, exact.recent, exact.bits) == (96, 192, 16)


def test_exact_bits_are_checked():
    def cfg(**kw):
        return LowRankConfig.from_dict({"mode": "lowrank", **kw})

    assert cfg(token_adaptive=True, exact_bits=8).exact_bits == 8
    with pytest.raises(LowRankConfigError, match=r"exact_bits=4 is not supported; .*\[16, 8\]"):
        cfg(token_adaptive=True, exact_bits=4)
    with pytest.raises(LowRankConfigError, match="add \"token_adaptive\": true"):
        cfg(exact_bits=8)


@pytest.mark.parametrize("raw,fragment", [
    ({"rank_fraction": 10**401}, "rank_fraction must be a finite number"),
    ({"rank_fraction": float("nan")}, "rank_fraction must be a finite number"),
    ({"head_group_size": 10**6}, "head_group_size=1000000 is too large"),
    ({"k_channel_tokens": 10**6}, "k_channel_tokens=1000000 is too large"),
    ({"quant_group_size": 10**6}, "quant_group_size=1000000 is too large"),
    ({"calibration_tokens": 300_000}, "calibration_tokens=300000 is too large"),
    ({"ranks": {"0": [0, 8]}}, r"ranks\[0\]=\[0, 8\]: each latent width must be a positive"),
    ({"artifact": "a\x00b"}, "artifact must be a directory path"),
])
def test_integers_and_numbers_are_bounded(raw, fragment):
    with pytest.raises(LowRankConfigError, match=fragment):
        LowRankConfig.from_dict({"mode": "lowrank", **raw})


def test_json_limits():
    from vllm_lowrank.inputs import MAX_JSON_DEPTH, json_depth, parse_json

    assert json_depth('{"a": "[[[[", "b": [[1]]}') == 3  # brackets in strings do not count
    assert parse_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH, "x") is not None
    with pytest.raises(LowRankConfigError, match="nests"):
        parse_json("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), "x")
    assert parse_json('{"n": -1234567890123456789}', "x") == {"n": -1234567890123456789}
    with pytest.raises(LowRankConfigError, match="integer of 20 digits"):
        parse_json('{"n": 12345678901234567890}', "x")


def test_rank_keys_from_python_may_be_ints_but_not_twice():
    cfg = LowRankConfig.from_dict({"mode": "lowrank", "ranks": {0: [64, 64], "1": [32, 32]}})
    assert dict(cfg.ranks) == {0: (64, 64), 1: (32, 32)}
    with pytest.raises(LowRankConfigError, match="names layer 3 twice"):
        LowRankConfig.from_dict({"mode": "lowrank", "ranks": {3: [8, 8], "3": [8, 8]}})
    for bad in (True, -1, "1_0", " 3", "+3", "\u0663", "3.0"):
        with pytest.raises(LowRankConfigError, match="not a layer index"):
            LowRankConfig.from_dict({"mode": "lowrank", "ranks": {bad: [8, 8]}})


def test_config_keys_document_every_field_once():
    import dataclasses

    from vllm_lowrank.config import config_keys

    documented = [n for names, _, _ in config_keys() for n in names]
    fields = [f.name for f in dataclasses.fields(LowRankConfig)
              if not f.metadata.get("internal") and f.name != "mode"]
    assert sorted(documented) == sorted(fields)


def test_readme_key_table_and_cli_help_come_from_config_keys():

    from vllm_lowrank.config import config_keys, keys_table
    from vllm_lowrank.patches import CONFIG_HELP

    readme = (REPO / "README.md").read_text()
    assert keys_table() in readme, "README key table drifted: paste config.keys_table()"
    for names, _, _ in config_keys():
        assert all(f"{n}" in CONFIG_HELP for n in names)
    assert "default 0.5" in CONFIG_HELP  # field defaults rendered (ratio)


def test_rope_equivariant_takes_the_fisher_rank_allocation():
    """Its energies are Fisher loss increases, like fisher's: the default
    rank_allocation "fisher" is accepted; a method without them is refused."""
    cfg = LowRankConfig.from_dict({"mode": "lowrank", "method": "rope_equivariant"})
    assert (cfg.method, cfg.rank_allocation) == ("rope_equivariant", "fisher")
    with pytest.raises(LowRankConfigError, match="rope_equivariant"):
        LowRankConfig.from_dict({"mode": "lowrank", "method": "eigen"})


def test_post_rope_keys_settings_are_checked_before_any_engine():
    """``post_rope_keys`` keeps full-width keys beside the exact tokens: it needs
    the token-adaptive mode, a rank fraction above the keys' half, no key basis
    method, and no preset whose allocation cuts key ranks; a ``ranks`` override
    must keep the full key width. Each refusal names the fix."""
    from vllm_lowrank.factorization.plan import AttentionShape, uniform_plan

    ok = {"mode": "lowrank", "post_rope_keys": True, "token_adaptive": True,
          "rank_fraction": 0.75}
    cfg = LowRankConfig.from_dict(ok)
    plan = uniform_plan(cfg, AttentionShape(576, 9, 3, 64), 0)
    assert plan.k_ranks == (192,) and plan.v_ranks == (96,)  # full keys, half the values
    for change, words in (({"token_adaptive": False}, "token_adaptive"),
                          ({"rank_fraction": 0.5}, "rank_fraction > 0.5"),
                          ({"method": "rope_equivariant"}, "key basis")):
        with pytest.raises(LowRankConfigError, match=words):
            LowRankConfig.from_dict({**ok, **change})
    with pytest.raises(LowRankConfigError, match="allocates ranks"):
        LowRankConfig.from_dict({"mode": "lowrank", "preset": "8x", "post_rope_keys": True})
    cut = LowRankConfig.from_dict({**ok, "ranks": {"0": [96, 96]}})
    with pytest.raises(LowRankConfigError, match="full width"):
        uniform_plan(cut, AttentionShape(576, 9, 3, 64), 0)
