"""``causal_lm.substitute``: while active, constructing exactly the named class
returns the factory's object built from the bound constructor arguments;
afterwards (and for subclasses) construction is untouched."""

import pytest

from vllm_lowrank.models.causal_lm import substitute


class Stock:
    def __init__(self, a, b=2, *, prefix="", **kwargs):
        self.args = (a, b, prefix, kwargs)


class Child(Stock):
    pass


def test_substitute_binds_arguments_and_restores():
    seen = []
    with substitute(Stock, lambda args: seen.append(args) or "latent"):
        assert Stock(1, prefix="layers.3.self_attn", extra=5) == "latent"
        child = Child(7)
    assert seen == [{"a": 1, "b": 2, "prefix": "layers.3.self_attn", "extra": 5}]
    assert isinstance(child, Child) and child.args == (7, 2, "", {})
    plain = Stock(4, 5)
    assert isinstance(plain, Stock) and plain.args == (4, 5, "", {})


def test_substitute_restores_after_an_error():
    with pytest.raises(ZeroDivisionError), substitute(Stock, lambda args: 1 / 0):
        Stock(1)  # the factory runs (and fails) inside the block
    assert isinstance(Stock(1), Stock) and Stock(1).args == (1, 2, "", {})


def test_substitute_keeps_a_class_own_new():
    class Counted:
        made = 0

        def __new__(cls, *args, **kwargs):
            cls.made += 1
            return super().__new__(cls)

        def __init__(self, x):
            self.x = x

    with substitute(Counted, lambda args: args["x"]):
        assert Counted(3) == 3
    obj = Counted(4)
    assert obj.x == 4 and Counted.made == 1
