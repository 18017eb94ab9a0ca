"""Random programs over linear layers, some with their weights side by side, against eager.

Each program reads two inputs (and values made from them) through six linear
layers, one at a time or a run of consecutive ones over one source, with random
writes between them: into an input, into a weight, into a
result that a later layer reads; some layers run with gradients turned on
inside. Some groups of layers have their weights packed side by side (so the
compile path may run them as one product), some weights are left apart, and
between the calls a weight may be moved out of its packed storage or updated in
place. Every call's result must be eager's, whatever the fusion pass decided.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streamdag as sd
from streamdag.frontend.adjacent_linears import pack_sibling_linears

D = 8  # every layer's input size: any two layers may read one input
LAYERS = 6
NAMES = tuple(f"l{i}" for i in range(LAYERS))


class Program(torch.nn.Module):
    """The layers ``l0``..``l5`` and a program of steps that ``forward`` interprets (Dynamo unrolls it)."""

    def __init__(self, outs: list[int], bias: bool, steps: tuple[tuple, ...]) -> None:
        super().__init__()
        for name, out in zip(NAMES, outs):
            setattr(self, name, torch.nn.Linear(D, out, bias=bias))
        self.steps = steps

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        sources = [x, y]
        results = []
        for step in self.steps:
            kind = step[0]
            if kind == "linear":  # a layer over one of the sources
                _, layer, src = step
                results.append(getattr(self, NAMES[layer])(sources[src % len(sources)]))
            elif kind == "siblings":  # consecutive layers over one source, as q, k and v projections
                _, first, count, src = step
                for layer in range(first, min(first + count, LAYERS)):
                    results.append(getattr(self, NAMES[layer])(sources[src % len(sources)]))
            elif kind == "grad":  # the same, with gradients turned on inside
                _, layer, src = step
                with torch.enable_grad():
                    results.append(getattr(self, NAMES[layer])(sources[src % len(sources)]).detach())
            elif kind == "write_source":  # an in-place write into an input the later layers read
                sources[step[1] % len(sources)].mul_(1.5).add_(0.25)
            elif kind == "write_weight":  # an in-place update of a weight between two layers
                getattr(self, NAMES[step[1]]).weight.add_(0.125)
            elif kind == "new_source":  # a result of the right width becomes a source
                sources.append(torch.tanh(sources[step[1] % len(sources)] * 0.5))
        if not results:
            return x.sum(-1, keepdim=True)
        return torch.cat([r.flatten(1) for r in results], 1)


_STEP = st.one_of(
    st.tuples(st.just("siblings"), st.integers(0, LAYERS - 1), st.integers(2, 4), st.integers(0, 3)),
    st.tuples(st.just("siblings"), st.integers(0, LAYERS - 1), st.integers(2, 4), st.integers(0, 3)),
    st.tuples(st.just("linear"), st.integers(0, LAYERS - 1), st.integers(0, 3)),
    st.tuples(st.just("linear"), st.integers(0, LAYERS - 1), st.integers(0, 3)),
    st.tuples(st.just("grad"), st.integers(0, LAYERS - 1), st.integers(0, 3)),
    st.tuples(st.just("write_source"), st.integers(0, 3)),
    st.tuples(st.just("write_weight"), st.integers(0, LAYERS - 1)),
    st.tuples(st.just("new_source"), st.integers(0, 3)),
)

#: ways to pack the six layers: groups of consecutive layers laid side by side
_GROUPINGS = [((0, 1, 2), (3, 4)), ((0, 1), (2, 3), (4, 5)), ((0, 1, 2, 3, 4, 5),), ((1, 3), (2, 5)), ()]


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(outs=st.lists(st.sampled_from([3, 4, 8]), min_size=LAYERS, max_size=LAYERS),
       bias=st.booleans(), grouping=st.sampled_from(_GROUPINGS),
       steps=st.lists(_STEP, min_size=2, max_size=10).map(tuple),
       between=st.sampled_from(["nothing", "move", "update"]), lead=st.sampled_from([(2,), (2, 3), (1, 1)]),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**16))
def test_random_programs_over_packed_and_apart_linear_layers_compute_what_eager_does(
        outs, bias, grouping, steps, between, lead, dtype, seed, fresh_dynamo):
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = Program(outs, bias, steps).eval().to(dtype)
    pack_sibling_linears(model, [tuple(NAMES[i] for i in group) for group in grouping])
    reference = copy.deepcopy(model)
    compiled = sd.compile(model)
    gen = torch.Generator().manual_seed(seed)
    for call in range(3):
        x, y = (torch.randn(*lead, D, generator=gen, dtype=dtype) for _ in range(2))
        with torch.no_grad():
            expected = reference(x.clone(), y.clone())
            got = compiled(x.clone(), y.clone())
        explained = f"call {call}:\n{compiled.explain()}"
        torch.testing.assert_close(got, expected, msg=lambda m, why=explained: f"{why}\n{m}")
        torch.testing.assert_close(model.state_dict(), reference.state_dict())  # (weights written alike)
        if call == 0 and between != "nothing":
            layer = NAMES[seed % LAYERS]
            with torch.no_grad():
                for m in (model, reference):
                    weight = getattr(m, layer).weight
                    if between == "move":  # out of its packed storage: the layout no longer holds
                        weight.data = weight.data.clone()
                    else:
                        weight.mul_(-1.0)
