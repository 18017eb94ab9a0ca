"""Memory regions: views of one storage are one buffer."""

import numpy as np
import pytest

import streamdag as sd
from streamdag.graph.buffers import region_of

torch = pytest.importorskip("torch")

#: each test runs on the compiled hot path and on its Python reference (the path fixture)
pytestmark = pytest.mark.usefixtures("path")


def test_numpy_slice_lies_inside_its_base():
    a = np.zeros((8, 8), dtype=np.float32)
    whole, row = region_of(a), region_of(a[3])
    assert whole.covers(row)
    assert row.nbytes == 8 * 4


def test_disjoint_slices_do_not_overlap():
    a = np.zeros(100)
    assert not region_of(a[:50]).overlaps(region_of(a[50:]))
    assert region_of(a[:51]).overlaps(region_of(a[50:]))


def test_transpose_and_reshape_span_the_same_bytes():
    a = np.arange(12.0).reshape(3, 4)
    assert region_of(a.T) == region_of(a) == region_of(a.reshape(4, 3))


def test_negative_strides_are_handled():
    a = np.arange(10.0)
    assert region_of(a[::-1]) == region_of(a)
    assert region_of(a[5::-1]) == region_of(a[:6])


def test_strided_view_is_taken_by_its_extent():
    a = np.arange(10.0)
    # even and odd elements interleave: the extent is conservative, never missing a conflict
    assert region_of(a[::2]).overlaps(region_of(a[1::2]))


def test_empty_view_touches_nothing():
    a = np.zeros(10)
    assert region_of(a[5:5]).nbytes == 0


def test_torch_views_and_numpy_sharing_memory_are_one_buffer():
    t = torch.zeros(6, 4)
    assert region_of(t).covers(region_of(t[2:4]))
    assert region_of(t.t()) == region_of(t)
    assert region_of(t.view(24)) == region_of(t)
    n = t.numpy()
    assert region_of(n) == region_of(t)
    assert region_of(torch.from_numpy(n[1])).overlaps(region_of(t[1]))
    assert region_of(t).space == "cpu"


def test_torch_storage_offset_counts():
    t = torch.zeros(100)
    assert not region_of(t[:50]).overlaps(region_of(t[50:]))


@pytest.mark.parametrize(("dtype", "item"),
                         [("U3", 12), ("M8[s]", 8), ("O", 8), ([("a", "i4"), ("b", "f8")], 12)])
def test_an_arrays_elements_span_their_bytes_whatever_the_dtype(dtype, item):
    """The array interface's typestr does not always count bytes (``<U3`` is 3 characters of 4
    bytes): each element spans ``itemsize`` bytes, in the compiled code and the Python code alike."""
    from streamdag.graph import buffers
    from streamdag.runtime import accel

    a = np.zeros(5, dtype=dtype)
    assert a.itemsize == item
    r = region_of(a)
    assert (r.start, r.end) == (a.__array_interface__["data"][0], a.__array_interface__["data"][0] + 5 * item)
    assert buffers._py_accesses([a[::2]], [])[0].region.nbytes == 5 * item
    assert accel.accesses([a[::2]], []) == buffers._py_accesses([a[::2]], [])


def test_non_buffer_is_refused_with_the_fix():
    with pytest.raises(sd.InvalidBuffer, match="numpy arrays or torch tensors"):
        region_of([1, 2, 3])


def test_sparse_tensor_is_refused():
    with pytest.raises(sd.InvalidBuffer, match="to_dense"):
        region_of(torch.zeros(3, 3).to_sparse())


def test_coalesce_merges_touching_ranges_and_keeps_writes():
    from streamdag.graph import Access, Region
    from streamdag.graph.buffers import coalesce

    got = coalesce([
        Access(Region("cpu", 0, 8), False),
        Access(Region("cpu", 8, 16), True),
        Access(Region("cpu", 32, 40), False),
        Access(Region("cuda:0", 0, 8), False),
    ])
    assert sorted(got, key=lambda a: (a.region.space, a.region.start)) == [
        Access(Region("cpu", 0, 16), True),
        Access(Region("cpu", 32, 40), False),
        Access(Region("cuda:0", 0, 8), False),
    ]
