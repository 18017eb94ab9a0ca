"""A replay's result structure, rebuilt by a function made at the capture, is what
``torch.utils._pytree.tree_unflatten`` builds: for any nesting of the containers pytree knows, and
for mapping-like dataclasses (Hugging Face's ``ModelOutput``) rebuilt without their constructor
only where that rebuild equals the captured object."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

from streamdag.frontend.unflatten import unflattener  # noqa: E402


class Pair(NamedTuple):
    first: Any
    second: Any


def _register(cls):
    pytree.register_pytree_node(cls, lambda o: (list(o.values()), list(o.keys())),
                                lambda values, keys: cls(**dict(zip(keys, values))))
    return cls


@_register
@dataclasses.dataclass
class Output(collections.OrderedDict):
    """As Hugging Face's ``ModelOutput``: fields as attributes, the fields set also as items."""

    logits: Any = None
    hidden: Any = None
    extra: Any = None
    built = 0  # constructor calls, counted

    def __post_init__(self):
        type(self).built += 1
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                self[f.name] = value

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)


@_register
@dataclasses.dataclass
class Derived(collections.OrderedDict):
    """A mapping dataclass whose constructor computes an attribute that is no item: only the
    constructor makes it."""

    logits: Any = None
    built = 0

    def __post_init__(self):
        type(self).built += 1
        self["logits"] = self.logits
        object.__setattr__(self, "norm", float(self.logits.sum()))


leaves = st.builds(lambda n: torch.full((2,), float(n)), st.integers(0, 9)) | st.none() | st.integers()
trees = st.recursive(leaves, lambda inner: (
    st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple)
    | st.dictionaries(st.sampled_from("abcd"), inner, max_size=3)
    | st.tuples(inner, inner).map(lambda p: Pair(*p))
    | st.dictionaries(st.sampled_from("abcd"), inner, max_size=3).map(collections.OrderedDict)
    | st.tuples(inner, inner).map(lambda p: Output(logits=torch.ones(1), hidden=p[0], extra=p[1]))),
    max_leaves=12)


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a is b
    if isinstance(a, dict):
        attrs_a, attrs_b = getattr(a, "__dict__", {}), getattr(b, "__dict__", {})
        return (list(a.keys()) == list(b.keys()) and all(_same(a[k], b[k]) for k in a)
                and attrs_a.keys() == attrs_b.keys() and all(_same(attrs_a[k], attrs_b[k]) for k in attrs_a))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    return a == b


@settings(max_examples=200, deadline=None)
@given(trees)
def test_the_rebuild_equals_tree_unflatten_for_any_nesting(tree):
    captured, spec = pytree.tree_flatten(tree)
    rebuild = unflattener(spec, tree)
    fresh = [torch.zeros(1) if isinstance(x, torch.Tensor) else x for x in captured]
    assert _same(rebuild(fresh), pytree.tree_unflatten(fresh, spec))


def test_a_model_output_is_rebuilt_without_its_constructor():
    out = Output(logits=torch.ones(2), hidden=torch.zeros(3))
    spec = pytree.tree_structure(out)
    rebuild = unflattener(spec, out)
    fresh = [torch.randn(2), torch.randn(3)]
    before = Output.built
    got = rebuild(fresh)
    assert Output.built == before
    want = pytree.tree_unflatten(fresh, spec)
    assert _same(got, want)
    assert got.logits is fresh[0] and got["hidden"] is fresh[1] and got.extra is None and "extra" not in got


def test_a_mapping_whose_constructor_makes_more_than_its_items_is_rebuilt_by_it():
    out = Derived(logits=torch.ones(2))
    spec = pytree.tree_structure(out)
    rebuild = unflattener(spec, out)
    before = Derived.built
    got = rebuild([torch.full((2,), 3.0)])
    assert Derived.built == before + 1 and got.norm == 6.0


def test_hugging_face_outputs_are_rebuilt_as_their_constructor_builds_them():
    outputs = pytest.importorskip("transformers.modeling_outputs")
    out = outputs.BaseModelOutputWithPooling(last_hidden_state=torch.ones(1, 2, 4),
                                             pooler_output=torch.ones(1, 4))
    spec = pytree.tree_structure(out)
    fresh = [torch.randn(1, 2, 4), torch.randn(1, 4)]
    got, want = unflattener(spec, out)(fresh), pytree.tree_unflatten(fresh, spec)
    assert _same(got, want)
    assert got.to_tuple() == want.to_tuple() and got[0] is fresh[0] and got.pooler_output is fresh[1]


def test_a_whole_call_of_a_hugging_face_encoder_returns_its_output_rebuilt_each_replay(fake_device):
    transformers = pytest.importorskip("transformers")
    from whole_call_stand_in import whole

    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64)
    torch.manual_seed(0)
    m = transformers.BertModel(cfg).eval()
    w, dynamo = whole(m, fake_device)
    replays = []
    with torch.inference_mode():
        for seed in range(5):
            ids = torch.randint(0, cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(seed))
            got, want = w((), {"input_ids": ids}, dynamo), m(input_ids=ids)
            assert type(got) is type(want) and list(got.keys()) == list(want.keys())
            for k in want:
                torch.testing.assert_close(got[k], want[k])
                assert getattr(got, k) is got[k]
            assert got.to_tuple()[0] is got.last_hidden_state
            replays.append(got)
    assert w.replays >= 2 and w._last[1].unflatten is not None
    assert replays[-1].last_hidden_state is not replays[-2].last_hidden_state  # the caller's own tensors
