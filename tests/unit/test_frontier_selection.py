"""``benchmarks/frontier.py --only``: a setting's whole name selects it alone,
any other string every setting whose name contains it."""

from __future__ import annotations

from conftest import benchmark_module


def _frontier():
    return benchmark_module("frontier")


def test_a_whole_name_selects_that_setting_alone():
    fr = _frontier()
    name = "allocated 8x, sink 32 + recent 256 int8"
    longer = [n for n in fr.SETTINGS if n != name and name in n]
    assert name in fr.SETTINGS and longer  # the case the rule exists for
    chosen = [n for n in fr.SETTINGS if fr.selected(n, [name])]
    assert chosen == [name]


def test_a_substring_selects_every_setting_containing_it():
    fr = _frontier()
    chosen = [n for n in fr.SETTINGS if fr.selected(n, ["preset "])]
    assert chosen == [n for n in fr.SETTINGS if n.startswith("preset ")] and len(chosen) == 4
    assert all(fr.selected(n, None) for n in fr.SETTINGS)
