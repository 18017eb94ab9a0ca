"""Writes through a boolean mask (``x[mask] = value``) made selects in Dynamo's graph: exactly where
the value is the same for every selected position, with the writes, results and gradients of the
code as written."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import streamdag as sd
from streamdag.frontend.masked_writes import rewrite_masked_writes


def _rewritten(fn, *args):
    """``fn(*args)`` through Dynamo with every graph rewritten: (its result, the writes made selects)."""
    counts: list[int] = []

    def backend(gm, example_inputs):
        counts.append(rewrite_masked_writes(gm))
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return out, sum(counts)


def _zero_negatives(x):
    x = x * 2
    x[x < 0] = 0.0
    return x


def _fill_rows(x, mask, row):
    y = x + 1
    y[mask] = row
    return y


def _fill_in_place(x, mask, value):
    x[mask] = value  # the caller's tensor, written as the code says
    return x.sum()


def _one_value_per_position(x, mask, values):
    y = x.clone()
    y[mask] = values  # a row per selected position: its count depends on the data
    return y


CASES = {
    "a number, a mask of every dimension": (_zero_negatives, lambda g: (torch.randn(3, 5, generator=g),)),
    "a row over the trailing dimension": (
        _fill_rows, lambda g: (torch.randn(2, 4, 8, generator=g), torch.rand(2, 4, generator=g) < 0.5,
                               torch.randn(8, generator=g))),
    "a row broadcast over two trailing dimensions": (
        _fill_rows, lambda g: (torch.randn(3, 4, 5, generator=g), torch.rand(3, generator=g) < 0.5,
                               torch.randn(1, 5, generator=g))),
    "a zero-dimensional tensor into an input": (
        _fill_in_place, lambda g: (torch.randn(4, 6, generator=g), torch.rand(4, 6, generator=g) < 0.5,
                                   torch.tensor(3.0))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_masked_write_of_one_value_for_every_position_becomes_a_select_with_the_same_effect(case):
    fn, make = CASES[case]
    args = make(torch.Generator().manual_seed(0))
    expected_args = copy.deepcopy(args)
    expected = fn(*expected_args)
    got, rewritten = _rewritten(fn, *args)
    assert rewritten == 1
    torch.testing.assert_close(got, expected)
    for a, b in zip(args, expected_args):  # and the writes into the arguments, as written
        torch.testing.assert_close(a, b)


def test_a_masked_write_of_a_value_per_selected_position_is_left_as_written():
    g = torch.Generator().manual_seed(0)
    x, mask = torch.randn(4, 3, generator=g), torch.tensor([True, False, True, False])
    values = torch.randn(2, 3, generator=g)
    got, rewritten = _rewritten(_one_value_per_position, x, mask, values)
    assert rewritten == 0
    torch.testing.assert_close(got, _one_value_per_position(x, mask, values))


def test_the_select_passes_the_gradients_the_masked_write_passes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, generator=g, requires_grad=True)
    row = torch.randn(8, generator=g, requires_grad=True)
    mask = torch.rand(2, 4, generator=g) < 0.5
    out, rewritten = _rewritten(_fill_rows, x, mask, row)
    assert rewritten == 1
    grads = torch.autograd.grad(out.square().sum(), (x, row))
    expected = torch.autograd.grad(_fill_rows(x, mask, row).square().sum(), (x, row))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_streamdag_compile_runs_a_masked_write_into_an_input_as_eager():
    g = torch.Generator().manual_seed(0)
    x, mask = torch.randn(4, 6, generator=g), torch.rand(4, 6, generator=g) < 0.5
    ref_x = x.clone()
    fast = sd.compile(_fill_in_place)
    with torch.inference_mode():
        got = fast(x, mask, torch.tensor(3.0))
    expected = _fill_in_place(ref_x, mask, torch.tensor(3.0))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(x, ref_x)
    assert fast.statistics().fallbacks == 0


class _MaskedFill(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.fill = torch.nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        h[mask] = self.fill
        return h.relu()


@pytest.mark.cuda
def test_on_cuda_a_masked_write_is_captured_in_the_whole_call_graph_and_replays_new_masks():
    """As a select the write needs no synchronizing ``nonzero``: the whole call is captured, and
    each replay reads the mask of its call."""
    torch.manual_seed(0)
    model = _MaskedFill().cuda().eval()
    fast = sd.compile(model)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for _ in range(5):
            x = torch.randn(4, 6, 8, generator=g).cuda()
            mask = (torch.rand(4, 6, generator=g) < 0.5).cuda()
            torch.testing.assert_close(fast(x, mask), model(x, mask))
    stats = fast.statistics()
    assert stats.whole_captures == 1 and stats.whole_replays >= 2, stats


_DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool]


def _write(x, mask, value):
    y = x + 0 if x.dtype is not torch.bool else x.clone()
    y[mask] = value
    return y


@settings(max_examples=150, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), dtype=st.sampled_from(_DTYPES),
       mask_dims=st.integers(1, 3), value_kind=st.sampled_from(["int", "float", "bool", "0-d", "row"]),
       value_dtype=st.sampled_from(_DTYPES), seed=st.integers(0, 2**16))
def test_random_masked_writes_compute_or_raise_what_the_write_as_written_does(
        shape, dtype, mask_dims, value_kind, value_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    big = 2**24 + 1 if dtype in (torch.int64, torch.int32) else 100  # (rounded through float32, it moves)
    x = (torch.randint(0, big, shape, generator=g) if not dtype.is_floating_point
         else torch.randn(shape, generator=g) * 3).to(dtype)
    mask = torch.rand(shape[:min(mask_dims, len(shape))], generator=g) < 0.5
    trailing = shape[mask.dim():]
    value: object = {"int": 7, "float": 2.75, "bool": True}.get(value_kind)
    if value_kind == "0-d":
        value = torch.tensor(2.75).to(value_dtype)
    elif value_kind == "row":
        value = (torch.rand(trailing, generator=g) * 5).to(value_dtype)
    try:
        expected = _write(x, mask, value)
    except RuntimeError as exc:  # the write as written raises (a row of another dtype): so must ours
        with pytest.raises(Exception, match=str(exc)[:40].replace("(", ".").replace(")", ".")):
            _rewritten(_write, x, mask, value)
        return
    got, _ = _rewritten(_write, x, mask, value)
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected), (x, mask, value, got, expected)
