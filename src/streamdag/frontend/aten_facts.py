"""What an aten graph does to its inputs and whether it draws random numbers: facts a training
graph's timing (which inputs to put back after a run) and its cut into regions (none where random
operators draw one seed per graph) read off the graph AOTAutograd hands the inner compiler."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

__all__ = ["dropout_p", "has_random", "written_inputs"]


def written_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """The placeholders an operator of ``gm`` writes in place (their schema marks the write)."""
    placeholders = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    written: set[int] = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        positional = [a for a in schema.arguments if not a.kwarg_only]
        values = list(zip(positional, node.args))
        values += [(a, node.kwargs[a.name]) for a in schema.arguments if a.name in node.kwargs]
        for arg, value in values:
            if arg.alias_info is not None and arg.alias_info.is_write and value in placeholders:
                written.add(placeholders[value])
    return sorted(written)


def has_random(gm: torch.fx.GraphModule) -> bool:
    """Whether an operator of ``gm`` draws random numbers: one tagged as seeded, unless its
    ``dropout_p`` is 0 (attention kernels are tagged for their dropout)."""
    return any(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) and dropout_p(n) != 0
               for n in gm.graph.nodes if n.op == "call_function")


def dropout_p(node: torch.fx.Node) -> Any:
    """The node's ``dropout_p`` argument (None where its operator has none)."""
    schema = node.target._schema  # type: ignore[union-attr]
    for i, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p":
            if arg.name in node.kwargs:
                return node.kwargs[arg.name]
            return node.args[i] if i < len(node.args) and not arg.kwarg_only else arg.default_value
    return None
