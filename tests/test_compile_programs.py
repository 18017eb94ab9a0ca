"""Random programs through ``streamdag.compile`` against eager, on the CPU.

A program is a sequence of steps over a list of values (``[batch, 8]`` tensors):
linear layers (several over one value: branches the region planner may cut
apart), pointwise operators, concatenations split back, views, reductions
broadcast back, and in-place writes into a value or into the caller's input. It
returns some of its values, and an input, in a tuple, a list or a dict, the same
value twice at times. Each program compiles with or without regions and is
called on new inputs, then on another batch size: its results and its writes
into the inputs must be eager's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streamdag as sd

C = 8


class Program(torch.nn.Module):
    def __init__(self, steps: tuple[tuple, ...], returns: tuple[int, ...], shape: str) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(C, C) for _ in range(4))
        self.steps, self.returns, self.shape = steps, returns, shape

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        values = [x * 1.0, y * 1.0]
        for kind, a, b in self.steps:
            u, v = values[a % len(values)], values[b % len(values)]
            if kind == "linear":
                values.append(self.layers[b % 4](u))
            elif kind == "relu":
                values.append(torch.relu(u) - 0.5 * v)
            elif kind == "add":
                values.append(u + v * 0.5)
            elif kind == "cat":
                values.append(torch.cat([u, v], 1)[:, C // 2:C + C // 2].contiguous())
            elif kind == "view":
                values.append(u.view(-1, 2, C // 2).transpose(1, 2).reshape(-1, C) * 1.25)
            elif kind == "reduce":
                values.append(u - u.mean(1, keepdim=True) + v.amax(0, keepdim=True))
            elif kind == "write":  # into a value that later steps may read
                u.mul_(0.75).add_(0.125)
            elif kind == "write_input":  # into the caller's tensor
                (x if a % 2 == 0 else y).add_(0.5)
        out = [values[i % len(values)] for i in self.returns]
        if self.shape == "dict":
            return {f"o{k}": t for k, t in enumerate(out)} | {"x": x}
        if self.shape == "list":
            return [*out, y]
        return (*out, x)


_KIND = st.sampled_from(["linear", "linear", "linear", "relu", "add", "cat", "view", "reduce", "write",
                         "write_input"])
_STEP = st.tuples(_KIND, st.integers(0, 15), st.integers(0, 15))


def _same(got, expected) -> None:
    if isinstance(expected, dict):
        assert got.keys() == expected.keys()
        for k in expected:
            torch.testing.assert_close(got[k], expected[k])
    else:
        assert type(got) is type(expected) and len(got) == len(expected)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(steps=st.lists(_STEP, min_size=1, max_size=12).map(tuple),
       returns=st.lists(st.integers(0, 15), min_size=1, max_size=4).map(tuple),
       shape=st.sampled_from(["tuple", "list", "dict"]), regions=st.sampled_from(["auto", "always"]),
       seed=st.integers(0, 2**16))
def test_random_programs_compiled_compute_and_write_what_eager_does(steps, returns, shape, regions, seed,
                                                                     fresh_dynamo):
    torch.manual_seed(seed)
    model = Program(steps, returns, shape).eval()
    reference = copy.deepcopy(model)
    compiled = sd.compile(model, regions=regions)
    gen = torch.Generator().manual_seed(seed)
    for batch in (3, 3, 5):
        x, y = torch.randn(batch, C, generator=gen), torch.randn(batch, C, generator=gen)
        ex, ey, cx, cy = x.clone(), y.clone(), x.clone(), y.clone()
        with torch.no_grad():
            expected = reference(ex, ey)
            got = compiled(cx, cy)
        _same(got, expected)
        torch.testing.assert_close((cx, cy), (ex, ey))  # the writes into the inputs, as eager made them


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(steps=st.lists(_STEP, min_size=1, max_size=10).map(tuple),
       regions=st.sampled_from(["auto", "always"]), seed=st.integers(0, 2**16))
def test_random_programs_trained_a_few_steps_get_eagers_gradients_and_parameters(
        steps, regions, seed, fresh_dynamo):
    """Forward, backward and an SGD step per call, with gradients on: the gradients and the parameters
    after each step are eager's (a program whose eager backward raises, for a value written in place
    after a product saved it, is skipped: the compiled one may not raise)."""
    # inputs stay as they are; a layer over the first input, and every value returned, so that the
    # loss reaches the layers
    steps = (("linear", 0, seed), *(s for s in steps if s[0] != "write_input"))
    torch.manual_seed(seed)
    model = Program(steps, tuple(range(2, 2 + len(steps))), "tuple").train()
    reference = copy.deepcopy(model)
    compiled = sd.compile(model, regions=regions)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, reference)]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):
        x, y = torch.randn(4, C, generator=gen), torch.randn(4, C, generator=gen)
        loss = sum(t.square().mean() for t in reference(x.clone(), y.clone())[:-1])
        if not loss.requires_grad:  # (no layer reaches the results: nothing to train)
            return
        try:
            loss.backward()
        except RuntimeError as exc:
            assert "inplace operation" in str(exc)
            return
        got = sum(t.square().mean() for t in compiled(x.clone(), y.clone())[:-1])
        got.backward()
        torch.testing.assert_close(got, loss)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, msg=lambda m, name=name: f"{name}: {m}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
        torch.testing.assert_close(model.state_dict(), reference.state_dict())
