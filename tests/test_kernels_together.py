"""Inductor's kernel waits of several compiles made together at the end of a block.

The unit tests call ``AsyncCompile.wait`` with scopes of Futures, as a loaded
module's last line does; the end-to-end test compiles an inception block's
regions with Inductor's CPU code generator and counts when its waits happen.
"""

import threading
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from torch._inductor import config as inductor_config  # noqa: E402
from torch._inductor.async_compile import AsyncCompile  # noqa: E402
from torch._inductor.virtualized import V  # noqa: E402

import streamdag.frontend.kernels_together as together  # noqa: E402
from streamdag.frontend.kernels_together import kernels_compiled_together  # noqa: E402


@pytest.fixture(autouse=True)
def _a_graph_compiled_with_a_pool_of_workers():
    """The waits below are made as a module of a graph that ``compile_fx`` lowers makes them (its
    graph handler unnamed), where Inductor compiles in workers (it waits for Futures only then).
    The routing is in place first: without it a wait for an unset Future would never return."""
    assert together._install() and AsyncCompile.wait is not together._original_wait
    with inductor_config.patch(compile_threads=2), V.set_graph_handler(SimpleNamespace(name=None)):
        yield


def scope_of(value):
    """A module's globals with one kernel still compiling: ``value`` once it is done."""
    future = Future()
    return {"__file__": "/tmp/module.py", "triton_kernel": future, "other": 1}, future, value


def test_a_wait_inside_the_block_is_made_at_its_end():
    scope, future, kernel = scope_of("compiled kernel")
    with kernels_compiled_together():
        AsyncCompile.wait(AsyncCompile(), scope)
        assert scope["triton_kernel"] is future  # not waited for yet
        future.set_result(kernel)  # finishes while the next graph is lowered
    assert scope["triton_kernel"] == kernel


def test_a_wait_outside_any_block_is_made_at_once():  # the negative control
    scope, future, kernel = scope_of("compiled kernel")
    future.set_result(kernel)
    AsyncCompile.wait(AsyncCompile(), scope)
    assert scope["triton_kernel"] == kernel


def test_a_wait_in_code_run_at_once_is_made_at_once():  # autotuning at compile time runs its kernels
    scope, future, kernel = scope_of("compiled kernel")
    del scope["__file__"]  # exec'd code's own dict, not a module's globals
    future.set_result(kernel)
    with kernels_compiled_together():
        AsyncCompile.wait(AsyncCompile(), scope)
        assert scope["triton_kernel"] == kernel


@pytest.mark.parametrize("graph", [SimpleNamespace(name="benchmark_decompose_k_mm"),
                                   SimpleNamespace(name=None, is_const_graph=True), None],
                         ids=["a subgraph timed while autotuning", "a constant graph", "no graph"])
def test_a_module_inductor_builds_on_the_side_waits_at_once(graph):  # it runs its kernels right away
    scope, future, kernel = scope_of("compiled kernel")
    future.set_result(kernel)
    with kernels_compiled_together(), V.set_graph_handler(graph):
        AsyncCompile.wait(AsyncCompile(), scope)
        assert scope["triton_kernel"] == kernel


def test_a_kernel_two_modules_share_is_waited_for_once_and_given_to_both():
    waited = []

    class Once(Future):
        def result(self, timeout=None):
            waited.append(self)
            return super().result(timeout)

    shared = Once()
    first = {"__file__": "/tmp/a.py", "triton_kernel": shared}
    second = {"__file__": "/tmp/b.py", "triton_kernel": shared}
    with kernels_compiled_together():
        AsyncCompile.wait(AsyncCompile(), first)
        AsyncCompile.wait(AsyncCompile(), second)
        shared.set_result("kernel")
    assert first["triton_kernel"] == second["triton_kernel"] == "kernel"
    assert waited == [shared]


def test_another_threads_wait_is_made_at_once_while_a_block_is_open():
    scope, future, kernel = scope_of("its kernel")
    future.set_result(kernel)
    with kernels_compiled_together():
        t = threading.Thread(target=AsyncCompile.wait, args=(AsyncCompile(), scope))
        t.start()
        t.join(timeout=30)
        assert scope["triton_kernel"] == kernel


def test_an_inner_block_waits_for_its_own_compiles_at_its_own_end():
    outer_scope, outer_future, _ = scope_of("outer")
    inner_scope, inner_future, _ = scope_of("inner")
    with kernels_compiled_together():
        AsyncCompile.wait(AsyncCompile(), outer_scope)
        with kernels_compiled_together():
            AsyncCompile.wait(AsyncCompile(), inner_scope)
            inner_future.set_result("inner")
        assert inner_scope["triton_kernel"] == "inner"
        assert outer_scope["triton_kernel"] is outer_future
        outer_future.set_result("outer")
    assert outer_scope["triton_kernel"] == "outer"


def test_a_block_that_fails_still_waits_and_raises_its_own_error():
    scope, future, _ = scope_of("kernel")
    with pytest.raises(ValueError, match="lowering failed"), kernels_compiled_together():
        AsyncCompile.wait(AsyncCompile(), scope)
        future.set_result("kernel")
        raise ValueError("lowering failed")
    assert scope["triton_kernel"] == "kernel"  # a later compile of the same code gets a usable module


def test_a_kernel_that_fails_to_compile_fails_the_block_after_every_wait_is_made():
    bad, bad_future, _ = scope_of("bad")
    good, good_future, _ = scope_of("good")
    with pytest.raises(RuntimeError, match="ptxas"), kernels_compiled_together():
        AsyncCompile.wait(AsyncCompile(), bad)
        AsyncCompile.wait(AsyncCompile(), good)
        bad_future.set_exception(RuntimeError("ptxas error"))
        good_future.set_result("good")
    assert good["triton_kernel"] == "good"


@pytest.mark.slow
def test_the_regions_of_an_inception_block_wait_for_their_kernels_once_all_are_lowered(monkeypatch):
    from compile_models import inception_in_regions

    torch._dynamo.reset()
    events = []

    def counted_wait(self, scope):
        events.append("wait")
        return real_wait(self, scope)

    import torch._inductor.compile_fx as compile_fx

    real_inner = compile_fx.compile_fx_inner

    def counted_inner(*args, **kwargs):
        events.append("compile")
        return real_inner(*args, **kwargs)

    assert together._install()  # the routing in place before the wait it calls is counted
    real_wait = together._original_wait
    monkeypatch.setattr(together, "_original_wait", counted_wait)
    monkeypatch.setattr(compile_fx, "compile_fx_inner", counted_inner)
    _, c, _ = inception_in_regions()
    program = c.backend.runners[0].switch.program
    assert program is not None and len(program.plan.regions) >= 4
    compiles = [i for i, e in enumerate(events) if e == "compile"]
    waits = [i for i, e in enumerate(events) if e == "wait"]
    assert len(compiles) == 1 + len(program.plan.regions), events  # the whole graph and each region
    assert waits and min(waits) > max(compiles), events  # no region waited before the last was lowered
    torch._dynamo.reset()
