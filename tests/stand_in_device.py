"""The CUDA calls of a whole-call graph, on the CPU: what tests of the whole-call path run on.

A subclass says what a capture leaves behind (a capture runs nothing, so what
the call updated in place goes back as it was) and what a replay computes.
"""

from __future__ import annotations

import contextlib

import torch


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
