"""What submit accepts as an op's function, arguments and declared buffers, and what it says to the rest.

Each test runs on the compiled submit and on its Python reference (the ``path`` fixture): the two
must agree.
"""

import asyncio
import time
import warnings

import numpy as np
import pytest

import streamdag as sd
from streamdag.graph.buffers import Marker, region_of

torch = pytest.importorskip("torch")

#: each test runs on the compiled hot path and on its Python reference (the path fixture)
pytestmark = pytest.mark.usefixtures("path")


class MyTensor(torch.Tensor):
    """A user's subclass: a tensor, whose memory is its storage's."""


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(8).as_subclass(MyTensor),
    lambda: torch.nn.Parameter(torch.zeros(8)),
], ids=["subclass", "parameter"])
def test_a_tensor_subclass_is_tracked_by_its_storage(make):
    t = make()
    assert region_of(t) == region_of(t.as_subclass(torch.Tensor))
    assert region_of(t[2:4]).overlaps(region_of(t))
    with sd.Runtime("cpu", streams=3) as rt:
        order = []
        rt.submit(lambda: (order.append("write"), t.data.add_(1)), writes=[t])
        rt.submit(lambda: order.append(("read", t.data.sum().item())), reads=[t[2:4]])
        rt.synchronize()
    assert order == ["write", ("read", 8.0)]


def test_a_meta_tensor_is_refused_with_what_to_do():
    meta = torch.empty(3, device="meta")
    with sd.Runtime("cpu", streams=1) as rt, pytest.raises(sd.InvalidBuffer, match="meta tensor has no"):
        rt.submit(print, reads=[meta])


@pytest.mark.parametrize("keyword", ["reads", "writes"])
def test_a_dict_of_buffers_is_refused_with_what_to_do(rt, keyword):
    with pytest.raises(TypeError, match=f"{keyword}= takes a list of buffers, not a dict"):
        rt.submit(print, **{keyword: {"a": np.zeros(3)}})


@pytest.mark.parametrize("data", [torch.arange(6.0), np.arange(6.0)], ids=["tensor", "numpy"])
def test_to_host_of_host_memory_is_a_copy_on_a_runtime_without_a_device(data):
    with sd.Runtime("cpu", streams=2) as rt:
        copy = rt.to_host(data).result()
    assert isinstance(copy, torch.Tensor) and copy.tolist() == list(range(6))
    assert not region_of(copy).overlaps(region_of(data))


def test_an_async_function_fails_its_op_with_what_to_do_and_no_warning(rt):
    async def produce():
        return 3

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a coroutine never awaited warns as it is freed)
        future = rt.submit(produce)
        error = future.exception()
        assert isinstance(error, TypeError) and "returned a coroutine" in str(error)
        assert "asyncio.run" in str(error)
        with pytest.raises(sd.ExceptionGroup):
            rt.synchronize()
    assert asyncio.run(_awaited(rt)) == 4


async def _awaited(rt):
    """An op's future is what async code awaits."""
    return await rt.submit(lambda: 4)


@pytest.mark.parametrize("method", ["submit", "submit_nowait"])
def test_submit_without_a_function_says_what_to_do(rt, method):
    with pytest.raises(TypeError, match=rf"{method}\(\) needs the function to run first"):
        getattr(rt, method)()
    with pytest.raises(TypeError, match=rf"{method}\(\) needs the function to run first"):
        getattr(rt, method)(reads=[np.zeros(2)])


@pytest.mark.parametrize("how", ["writes", "marker"])
def test_a_new_buffer_at_the_address_of_a_failed_ops_output_is_not_failed_by_it(rt, how):
    """A failed op fails the later ops on what it wrote until synchronize(): its memory must not go
    to a new, unrelated buffer meanwhile (numpy hands a freed block to the next array of its size
    at once), even where the op's function does not hold it (declared in writes= only)."""
    size = 1 << 12

    def fails(*_):
        raise ValueError("the old op")

    out = np.empty(size)
    address = out.ctypes.data
    failed = rt.submit(fails, writes=[out]) if how == "writes" else rt.submit(fails, sd.write(out))
    assert isinstance(failed.exception(), ValueError)
    del out, failed
    for _ in range(64):  # allocated until the old address comes back, if it can
        fresh = np.empty(size)
        if fresh.ctypes.data == address:
            break
    assert rt.submit(fresh.fill, 1.0, writes=[fresh]).exception() is None
    with pytest.raises(sd.ExceptionGroup, match="1 streamdag op"):
        rt.synchronize()


def _slow_fill(value):
    def fill(target):
        time.sleep(0.05)  # a reader not ordered after it would see zeros
        target[:] = value
    return fill


@pytest.mark.parametrize("wrap", [
    lambda m: [m],
    lambda m: (0, m),
    lambda m: {"x": m},
    lambda m: [{"x": (m,)}],
], ids=["list", "tuple", "dict", "nested"])
def test_markers_in_a_list_tuple_or_dict_argument_declare_their_access_and_are_unwrapped(rt, wrap):
    a = np.zeros(8)

    def first(container):  # the marked value, wherever wrap put it
        while not isinstance(container, np.ndarray):
            assert not isinstance(container, Marker), "the op got a marker"
            container = container[-1] if isinstance(container, (list, tuple)) else container["x"]
        return container

    rt.submit(lambda c: _slow_fill(1.0)(first(c)), wrap(sd.write(a)))
    as_keyword = rt.submit(lambda *, c: first(c).sum(), c=wrap(sd.read(a)))
    assert as_keyword.result() == 8.0


def test_containers_without_markers_reach_the_op_as_they_are(rt):
    items, table = [np.zeros(2)], {"k": 1}
    items.append(items)  # a list inside itself
    got = rt.submit(lambda x, *, t: (x, t), items, t=table).result()
    assert got[0] is items and got[1] is table


def test_a_container_argument_that_running_ops_change_meanwhile_is_walked_without_error(rt):
    """A results dict (and list) passed to every op, which the ops fill in: each submit walks it
    for markers while earlier ops add to it on other threads."""
    import sys

    results: dict[int, float] = {i: 0.0 for i in range(2000)}
    log: list[int] = list(range(2000))

    def fill(i, table, seen):
        for j in range(50):
            table[10_000 + 50 * i + j] = float(j)
            seen.append(j)
        return i

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch inside the walk
    try:
        futures = [rt.submit(fill, i, results, log) for i in range(40)]
        assert [f.result(timeout=30) for f in futures] == list(range(40))
    finally:
        sys.setswitchinterval(interval)
    assert len(results) == 2000 + 40 * 50 and len(log) == 2000 + 40 * 50


def test_memory_on_a_device_the_runtime_lacks_is_refused_with_the_fix(rt):
    from streamdag.graph import Region

    with pytest.raises(sd.InvalidBuffer, match=r"device='cuda:0'"):
        rt.submit(print, reads=[Region("cuda:0", 0, 8)])
