"""The CUDA calls of a whole-call graph, on the CPU: what tests of the whole-call path run on.

A subclass says what a capture leaves behind (a capture runs nothing, so what
the call updated in place goes back as it was) and what a replay computes.
"""

from __future__ import annotations

import contextlib

import torch

from streamdag.frontend.whole_replay import empty_like_input, fill_tensors, with_tensors_replaced


class StandInDevice:
    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.replays = 0
        self.graph_ms: list[float] | None = None  # what time_graphs says, else the same for each

    def time_graphs(self, graphs, rounds):
        return list(self.graph_ms) if self.graph_ms is not None else [1.0] * len(graphs)

    def caller(self):
        return None

    def on_capture_stream(self):
        return contextlib.nullcontext()

    def join(self, caller, outputs):
        pass

    def order(self):
        pass

    def copy_into(self, dsts, srcs):
        return False

    def launch_plan(self, args, kwargs, statics, replay, inference_mode):
        return None  # the Python launch (Entry.launch_if keys the call)

    def fresh_copies(self, tensors):
        return None  # torch.empty_like and a copy each

    def capture_beside(self, graph, fn, args, kwargs):
        """``capture`` again: the stand-in has no memory pools."""
        return self.capture(fn, args, kwargs)

    def capture_own_inputs(self, fn, args, kwargs, inputs, private=False):
        """``capture`` on tensors of the graph's own in place of ``inputs``, holding their values."""
        own = [empty_like_input(t) for t in inputs]
        fill_tensors(own, list(inputs))
        own_args, own_kwargs = with_tensors_replaced(args, kwargs, inputs, own)
        graph, out = self.capture(fn, own_args, own_kwargs, private)
        return graph, out, own
