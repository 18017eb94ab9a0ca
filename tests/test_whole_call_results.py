"""Whole-call graphs: what a replay returns (containers, constants, keyword arguments, plain objects
such as caches), each call's result new and the caller's own. On the CPU, with the stand-in device."""

import collections
import types

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from whole_call_stand_in import MODES, whole  # noqa: E402


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, scale=1.0):
        h = self.lin(x) * scale
        return {"h": h, "both": (h, h.relu()), "n": 3, "none": None}


@pytest.mark.parametrize("mode", list(MODES))
def test_containers_constants_and_keyword_arguments_come_back_as_the_model_returns_them(fake_device, mode):
    m = Structured().eval()
    w, dynamo = whole(m, fake_device)
    with MODES[mode]():
        for _ in range(3):
            x = torch.randn(2, 4)
            got, want = w((x,), {"scale": 2.0}, dynamo), m(x, scale=2.0)
            assert got["n"] == 3 and got["none"] is None and isinstance(got["both"], tuple)
            torch.testing.assert_close(got["both"][1], want["both"][1])
            assert got["h"] is got["both"][0], "one tensor returned twice stays one tensor"
    assert w.replays == 2


class Box:
    """A plain object holding tensors, as a model's cache is."""

    def __init__(self, t, extra):
        self.t, self.extra, self.label = t, extra, "box"


def test_a_plain_object_in_the_result_comes_back_new_at_each_replay_holding_its_tensors(fake_device):
    class Boxed(nn.Module):
        def forward(self, x):
            return x + 1, Box(x * 2, [x * 3, {"n": 4}])

    m = Boxed()
    w, dynamo = whole(m, fake_device)
    got = []
    with torch.no_grad():
        for i in range(4):
            x = torch.full((2,), float(i))
            got.append((x, w((x,), {}, dynamo)))
    assert w.replays == 3 and w.captures == 1, w.explain()
    for x, (plus, box) in got:
        assert isinstance(box, Box) and box.label == "box" and box.extra[1] == {"n": 4}
        assert list(vars(box)) == ["t", "extra", "label"]  # its attributes in the model's order
        torch.testing.assert_close(box.t, x * 2)
        torch.testing.assert_close(box.extra[0], x * 3)
        torch.testing.assert_close(plus, x + 1)
    assert got[2][1][1] is not got[3][1][1] and got[2][1][1].t is not got[3][1][1].t


class _Holder:
    def __init__(self, value):
        self.value = value


@pytest.mark.parametrize("inner, named", [
    (lambda x: (i for i in range(2)), "a generator"),
    (lambda x: nn.Linear(2, 2), "a Linear"),
    (lambda x: _Holder(None), "a _Holder that holds itself"),
])
def test_a_result_object_that_cannot_be_rebuilt_stays_on_dynamos_path_and_says_why(fake_device, inner, named):
    class Odd(nn.Module):
        def forward(self, x):
            held = _Holder(inner(x))
            if isinstance(held.value, _Holder):
                held.value = held
            return x * 2, held

    m = Odd()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        for _ in range(3):
            w((torch.randn(2),), {}, dynamo)
    assert w.captures == 0 and f"the result holds a _Holder that holds {named}" in w.explain(), w.explain()


class _Tagged(dict):
    """A dict subclass with attributes: its items live in the dict, not in its ``__dict__``."""


class _Pair(collections.namedtuple("_Pair", "a b")):
    """A namedtuple subclass without ``__slots__``: it has a ``__dict__`` and a ``__new__`` of its own."""


@pytest.mark.parametrize("inner, contents, named", [
    (lambda x: _Tagged(t=x * 3), lambda v: list(v.values()), "a _Tagged"),
    (lambda x: _Pair(x * 3, 1), list, "a _Pair"),
])
def test_a_result_object_made_by_its_own_new_stays_on_dynamos_path_not_rebuilt_empty(fake_device, inner,
                                                                                       contents, named):
    class Odd(nn.Module):
        def forward(self, x):
            return x * 2, _Holder(inner(x))

    m = Odd()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2)
            got, want = w((x,), {}, dynamo)[1].value, m(x)[1].value
            assert type(got) is type(want)
            torch.testing.assert_close(contents(got), contents(want))
    assert w.captures == 0 and f"the result holds a _Holder that holds {named}" in w.explain(), w.explain()


class WritesOnly(nn.Module):
    def forward(self, x):
        x.mul_(2.0)  # the caller's tensor holds the result; nothing is returned


def test_a_call_that_returns_no_tensor_replays(fake_device):
    m = WritesOnly()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        for i in range(3):
            x = torch.full((2,), float(i))
            assert w((x,), {}, dynamo) is None
            torch.testing.assert_close(x, torch.full((2,), 2.0 * i))
    assert w.replays == 2, w.explain()


class _Private:
    """Its slot's name is mangled: the attribute is ``_Private__t``."""

    __slots__ = ("__t",)

    def __init__(self, t):
        self.__t = t

    def value(self):
        return self.__t


def test_a_result_object_with_a_private_slot_comes_back_holding_it(fake_device):
    class Hidden(nn.Module):
        def forward(self, x):
            return _Private(x * 2)

    m = Hidden()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2)
            torch.testing.assert_close(w((x,), {}, dynamo).value(), x * 2)
    assert w.replays == 2, w.explain()


def test_an_object_the_result_holds_twice_comes_back_as_one_object(fake_device):
    class Shares(nn.Module):
        def forward(self, x):
            box = Box(x * 2, [x * 3])
            box.again = box.extra  # one list under two names, as deepcopy keeps it
            box.space = types.SimpleNamespace(t=x * 4)
            return box, box

    m = Shares()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2)
            first, second = w((x,), {}, dynamo)
            assert first is second and first.again is first.extra
            torch.testing.assert_close(first.extra[0], x * 3)
            torch.testing.assert_close(first.space.t, x * 4)
    assert w.replays == 2, w.explain()


class Pooled(nn.Module):
    """Hidden states and views of them, as a vision transformer returns its first token."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return {"seq": h, "first": h[:, 0], "last": h[:, -1].unsqueeze(1), "other": h.relu()}


def test_outputs_that_are_views_of_each_other_replay_and_share_memory_as_the_models_do(fake_device):
    m = Pooled().eval()
    w, dynamo = whole(m, fake_device)
    got = []
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 3, 4)
            got.append((x, w((x,), {}, dynamo)))
    assert w.replays == 3 and w.captures == 1, w.explain()
    with torch.no_grad():
        for x, out in got:  # each call's result its own: later replays left it alone
            want = m(x)
            for k in want:
                torch.testing.assert_close(out[k], want[k])
                assert out[k].stride() == want[k].stride()
    out = got[-1][1]
    seq = out["seq"].untyped_storage().data_ptr()
    assert out["first"].untyped_storage().data_ptr() == seq == out["last"].untyped_storage().data_ptr()
    assert out["other"].untyped_storage().data_ptr() != seq
    out["seq"][:, 0] = 7.0  # a view of the result follows a write into it, as the model's would
    assert bool((out["first"] == 7.0).all())
    assert got[-2][1]["first"].untyped_storage().data_ptr() != seq, "two calls' results share memory"


def test_outputs_far_apart_in_one_tensor_stay_on_dynamos_path_and_say_why(fake_device):
    class Ends(nn.Module):
        def forward(self, x):
            h = x * 2
            return h[0, :1], h[-1, -1:]

    m = Ends()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(64, 64)
            got = w((x,), {}, dynamo)
            torch.testing.assert_close(got, m(x))
    assert w.captures == 0 and "far apart" in w.explain(), w.explain()


def test_an_output_that_is_a_lazy_conjugate_of_another_stays_on_dynamos_path_and_says_why(fake_device):
    class Conjugated(nn.Module):
        def forward(self, x):
            h = x * 2
            return h, h.conj()  # a view with the conjugate bit: a plain as_strided of a copy would lose it

    m = Conjugated()
    w, dynamo = whole(m, fake_device)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 3, dtype=torch.cfloat)
            got = w((x,), {}, dynamo)
            torch.testing.assert_close(got[1].resolve_conj(), m(x)[1].resolve_conj())
    assert w.captures == 0 and "lazy conjugate" in w.explain(), w.explain()
