"""Nested outputs as engines return them: tuples, lists, dicts, named tuples and dataclasses (frozen, with
slots, with unset fields, pointing back at a parent, a dict besides), flattened and mapped."""

import collections
import dataclasses

import torch

from cudagraph_lifecycle.trees import leaves, map_leaves

Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass(frozen=True, slots=True)
class Frozen:
    logits: torch.Tensor
    extra: tuple = ()


@dataclasses.dataclass
class Step:
    out: torch.Tensor
    prev: "Step | None" = None
    cache: list = dataclasses.field(init=False)  # never set by some engines


@dataclasses.dataclass
class DictOut(dict):  # a generate-style output: a dataclass and a dict of the same fields
    logits: torch.Tensor = None

    def __post_init__(self):
        self["logits"] = self.logits


def test_leaves_and_map_leaves_see_every_tensor_and_keep_the_containers():
    t1, t2, t3 = torch.ones(1), torch.ones(2), torch.ones(3)
    nested = {"a": [t1, Pair(t2, None)], "b": Frozen(t3, ("x",))}
    assert [x for x in leaves(nested) if isinstance(x, torch.Tensor)] == [t1, t2, t3]
    doubled = map_leaves(lambda t: t * 2 if isinstance(t, torch.Tensor) else t, nested)
    assert isinstance(doubled["a"][1], Pair) and isinstance(doubled["b"], Frozen)
    assert doubled["b"].logits.sum() == 6 and doubled["b"].extra == ("x",) and nested["b"].logits.sum() == 3


def test_an_unset_field_and_a_cycle_are_walked_once():
    first = Step(torch.ones(1))
    second = Step(torch.ones(2), prev=first)
    first.prev = second  # a cycle
    assert sorted(x.numel() for x in leaves(second) if isinstance(x, torch.Tensor)) == [1, 2]
    copied = map_leaves(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, second)
    assert copied.out is not second.out and copied.prev.out is not first.out
    assert copied.prev.prev is copied  # the cycle closes on the copy: nothing of the original is kept
    shared = [torch.ones(1)]
    pair = map_leaves(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (shared, shared))
    assert pair[0] is pair[1] and pair[0][0] is not shared[0]  # mapped once, shared in the copy


def test_a_dataclass_that_is_a_dict_is_copied_as_both():
    out = DictOut(torch.ones(2))
    copied = map_leaves(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)
    assert type(copied) is DictOut and copied.logits is not out.logits and copied["logits"] is not out["logits"]
    assert torch.equal(copied.logits, out.logits) and torch.equal(copied["logits"], out["logits"])
