"""What a training graph reads from AOTAutograd's metadata of the graph being compiled
(``TracingContext.fw_metadata``): how many of a forward's outputs are its returns, and a
backward's donated buffers, which its regions must not be compiled with."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx

__all__ = ["forward_returns", "no_donated_buffers"]


@contextlib.contextmanager
def no_donated_buffers(ctx: Any) -> Iterator[None]:
    """No donated buffers while a backward's regions compile: Inductor reads AOTAutograd's donated
    indices as placeholder indices of the graph it compiles, which in a region name other
    tensors, and a saved activation one region may reuse as scratch may be read by another."""
    meta = getattr(ctx, "fw_metadata", None)
    donated = getattr(meta, "bw_donated_idxs", None)
    if not donated or meta is None:
        yield
        return
    meta.bw_donated_idxs = []
    try:
        yield
    finally:
        meta.bw_donated_idxs = donated


def forward_returns(gm: torch.fx.GraphModule, meta: Any) -> int | None:
    """How many of a training forward's outputs are returns (the rest: activations saved for the
    backward): AOTAutograd's count, else past the last output Inductor marks as the user's."""
    n = getattr(meta, "num_forward_returns", None)
    if isinstance(n, int):
        return n
    visible = next(iter(reversed(gm.graph.nodes))).meta.get("user_visible_output_idxs")
    return None if visible is None else max(visible, default=-1) + 1

