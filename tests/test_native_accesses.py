"""The compiled accesses of tensors and arrays (``native/_speedups.c``) against the Python ones:
the same regions as memory is reused, and the same clear error for what is not memory."""

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamdag import native
from streamdag.graph import Access, Region, buffers
from streamdag.runtime import accel

torch = pytest.importorskip("torch")


compiled = pytest.mark.skipif(native.load() is None, reason=f"no compiled hot path: {native.status()}")


def _tensors():
    base = torch.arange(64, dtype=torch.float32)
    return [
        base, base[3:17], base[::3], base.view(8, 8).t(), base[5:5], torch.zeros(0, 4),
        torch.zeros(3, 4, dtype=torch.float64)[:, 1], torch.nn.Parameter(torch.ones(4)),
        np.arange(10), np.arange(12).reshape(3, 4)[:, ::2], torch.tensor(3.0),
    ]


def test_accesses_of_tensors_and_arrays_equal_the_python_ones():
    values = _tensors()
    got = accel.accesses(values[:6], values[6:])
    assert got == buffers._py_accesses(values[:6], values[6:])
    assert [type(a) for a in got] == [Access] * len(values)
    assert all(type(a.region) is Region for a in got)
    assert [a.write for a in got] == [False] * 6 + [True] * 5


@compiled
@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 40), st.booleans()), min_size=1, max_size=60))
def test_accesses_stay_equal_to_the_python_ones_as_memory_is_reused(program):
    """The compiled accesses hand out the same Region and Access objects again for a range seen
    before: freed memory that comes back with another size, views into one buffer, a read then a
    write of one tensor, and more ranges than it keeps must all still read as the Python code does."""
    base = torch.zeros(4096)
    kept = []
    for size, offset, write in program:
        t = torch.empty(size) if size % 2 else base[offset:offset + size]
        reads, writes = ([t], [t]) if write else ([t], [])
        assert accel.compiled_accesses(reads, writes) == buffers._py_accesses(reads, writes)
        kept = [*kept[-3:], t]  # some stay alive, the rest go back to the allocator
    # more ranges than the compiled code keeps: some share a start, some an end
    many = [base[i:i + 1] for i in range(1500)] + [base[:k] for k in range(1, 1500)]
    many += [base[k:] for k in range(1500)]
    for order in (many, many[::-1], many[::7] + many):
        assert accel.compiled_accesses(order, order[:700]) == buffers._py_accesses(order, order[:700])


def _numpy_arrays():
    """Arrays whose byte range the compiled code reads through the buffer protocol (or, where numpy
    exports none, hands to the Python code): views of every kind, dtypes that export no buffer."""
    dtypes = st.sampled_from(["f8", "f4", "i2", "u1", ">i4", "c16", "?", "O", "M8[s]", "U3",
                              [("a", "i4"), ("b", "f8")]])
    shapes = st.lists(st.integers(0, 5), max_size=3)

    @st.composite
    def array(draw):
        shape = draw(shapes)
        base = np.zeros(shape, dtype=draw(dtypes))
        kind = draw(st.sampled_from(["plain", "step", "reversed", "transposed", "broadcast",
                                     "readonly", "scalar", "subclass"]))
        if kind == "step" and base.ndim:
            return base[:: draw(st.integers(1, 3))]
        if kind == "reversed" and base.ndim:
            return base[::-1]
        if kind == "transposed":
            return base.T
        if kind == "broadcast" and base.ndim and base.shape[0]:
            return np.broadcast_to(base[:1], (4, *base.shape[1:]))
        if kind == "readonly":
            base.flags.writeable = False
        if kind == "scalar":
            return np.zeros((), dtype=base.dtype)
        if kind == "subclass":
            return base.view(np.ma.MaskedArray) if base.dtype != object else base
        return base

    return array()


@compiled
@settings(max_examples=300 if os.environ.get("CI") else 80, deadline=None)
@given(st.lists(_numpy_arrays(), min_size=1, max_size=4), st.integers(0, 4))
def test_accesses_of_numpy_arrays_equal_the_python_ones(arrays, split):
    """The compiled code reads a numpy array through the buffer protocol, not its
    ``__array_interface__``: the same byte range for every view and dtype, or the Python code's."""
    reads, writes = arrays[:split], arrays[split:]
    assert accel.compiled_accesses(reads, writes) == buffers._py_accesses(reads, writes)


@pytest.mark.parametrize("bad", [torch.zeros(4).to_sparse(), [1, 2], "text"])
def test_accesses_of_what_is_not_memory_raise_the_same_clear_error(bad):
    with pytest.raises(sd_invalid()) as compiled_error:
        accel.accesses([bad], [])
    with pytest.raises(sd_invalid()) as python_error:
        buffers._py_accesses([bad], [])
    assert str(compiled_error.value) == str(python_error.value)


def sd_invalid():
    from streamdag import InvalidBuffer

    return InvalidBuffer
