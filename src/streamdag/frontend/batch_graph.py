"""Graph surgery shared by the batching passes (``batching.py``, ``batch_elementwise.py``).

Finding groups of mutually independent nodes of one kind, recognizing slices of one tensor
(by ``unbind`` or along channels), replacing a group's members by slices of one batched node,
and putting a rewritten graph back in topological order. Plain functions over fx graphs: no state.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

if TYPE_CHECKING:
    from .batching import BatchReport

aten = torch.ops.aten


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _stackable(gm: torch.fx.GraphModule, report: BatchReport, *nodes: Any) -> bool:
    """Whether the constants behind these get_attr nodes can be stacked (None: no constant)."""
    ok = True
    for node in nodes:
        if node is not None and getattr(gm, node.target).is_inference():
            report.inference_constants.add(node.target)
            ok = False
    return ok


def _descendants(nodes: list[torch.fx.Node]) -> dict[torch.fx.Node, int]:
    """Bit set of the nodes reachable from each node (bits by position in ``nodes``)."""
    index = {n: i for i, n in enumerate(nodes)}
    reach: dict[torch.fx.Node, int] = {}
    for n in reversed(nodes):
        bits = 0
        for user in n.users:
            if user in index:
                bits |= reach[user] | (1 << index[user])
        reach[n] = bits
    return reach


def _independent_groups(candidates: list[torch.fx.Node], reach: dict, index: dict) -> list[list]:
    """Greedy groups of candidates with no path between any two of them."""
    groups: list[tuple[list[torch.fx.Node], int, int]] = []  # members, their bits, their reach
    for n in candidates:
        bit = 1 << index[n]
        for g in groups:
            members, bits, reached = g
            if not (reached & bit) and not (reach[n] & bits):
                members.append(n)
                groups[groups.index(g)] = (members, bits | bit, reached | reach[n])
                break
        else:
            groups.append(([n], bit, reach[n]))
    return [members for members, _, _ in groups if len(members) > 1]


def _groups_by_key(gm: torch.fx.GraphModule, report: BatchReport, key_of: Any
                   ) -> tuple[list[list[torch.fx.Node]], dict[torch.fx.Node, int]]:
    """Groups of mutually independent nodes with one ``key_of(node)`` (None: not a candidate)
    that the report admits, and every node's position."""
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    reach = _descendants(nodes)
    by_key: dict[Any, list[torch.fx.Node]] = {}
    for n in nodes:
        key = key_of(n)
        if key is not None:
            by_key.setdefault(key, []).append(n)
    groups = [g for cands in by_key.values() for g in _independent_groups(cands, reach, index)]
    return [g for g in groups if report.admits(g)], index


def _one_group_at_a_time(gm: torch.fx.GraphModule, report: BatchReport, key_of: Any, rewrite: Any) -> bool:
    """Rewrite groups one by one, finding them again after each.

    Groups whose members read arbitrary inputs cannot all be merged at once:
    with a member of each feeding the other's inputs, two groups are each
    independent, but merged they would wait on each other (a cycle).
    """
    changed = False
    for _ in range(len(gm.graph.nodes)):  # every rewrite removes at least two candidates
        groups, index = _groups_by_key(gm, report, key_of)
        if not groups:
            break
        rewrite(groups[0], index)
        gm.graph = _topological(gm.graph)
        changed = True
    return changed


def _topological(graph: torch.fx.Graph) -> torch.fx.Graph:
    """The same graph with its nodes in an order where every input comes first."""
    placed: set[torch.fx.Node] = set()
    order: list[torch.fx.Node] = []

    def inputs(n: torch.fx.Node) -> Iterable[torch.fx.Node]:
        found: list[torch.fx.Node] = []
        torch.fx.node.map_arg((n.args, n.kwargs), found.append)
        return found

    open_: set[torch.fx.Node] = set()  # expanded, inputs not all placed yet
    for root in graph.nodes:
        stack = [(root, False)]
        while stack:
            n, expanded = stack.pop()
            if n in placed:
                continue
            if expanded:
                placed.add(n)
                open_.discard(n)
                order.append(n)
                continue
            if n in open_:
                raise RuntimeError(f"batching made a cycle through {n.name!r}: this is a streamdag bug; "
                                   "pass batch=False to streamdag.compile meanwhile")
            open_.add(n)
            stack.append((n, True))
            stack.extend((i, False) for i in inputs(n) if i not in placed)
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in order:
        env[n] = new.node_copy(n, lambda x: env[x])
    return new


def _slices_of(args: list[Any]) -> torch.fx.Node | None:
    """The tensor whose ``unbind`` slices ``args`` are, all of them and in order; else None."""
    found = _slice_range_of(args)
    if found is None or found[1:] != (0, 1) or len(_val(args[0].args[0]) or ()) != len(args):
        return None
    return found[0]


def _slice_range_of(args: list[Any]) -> tuple[torch.fx.Node, int, int] | None:
    """``(tensor, k, step)`` when ``args`` are its ``unbind`` slices ``k, k+step, ...``; else None."""
    if not args or not all(isinstance(a, torch.fx.Node) and a.target is operator.getitem for a in args):
        return None
    source = args[0].args[0]
    if not (isinstance(source, torch.fx.Node) and source.target is aten.unbind.int
            and (len(source.args) < 2 or source.args[1] == 0)):
        return None
    k = args[0].args[1]
    step = args[1].args[1] - k if len(args) > 1 else 1
    if step < 1 or [a.args[0] for a in args] != [source] * len(args) or \
            [a.args[1] for a in args] != list(range(k, k + step * len(args), step)):
        return None
    return source.args[0], k, step


def _unbind(graph: torch.fx.Graph, batched: torch.fx.Node, members: list[torch.fx.Node]) -> None:
    """Replace each member's uses by its slice of ``batched``."""
    with graph.inserting_after(batched):
        parts = graph.call_function(aten.unbind.int, (batched, 0))
    _replace_by_items(graph, parts, members)


def _replace_by_items(graph: torch.fx.Graph, listing: torch.fx.Node, members: list[torch.fx.Node]) -> None:
    """Replace member ``i``'s uses by item ``i`` of ``listing`` (a node whose value is a list)."""
    listing.meta["val"] = [_val(m) for m in members]
    previous = listing
    for i, member in enumerate(members):
        with graph.inserting_after(previous):
            piece = graph.call_function(operator.getitem, (listing, i))
        piece.meta["val"] = _val(member)
        member.replace_all_uses_with(piece)
        previous = piece


def _channels(node: torch.fx.Node) -> int | None:
    if "channels" in node.meta:
        return node.meta["channels"]
    val = _val(node)
    return int(val.shape[1]) if val is not None and val.dim() > 1 else None


def _channel_slices_of(args: list[Any]) -> torch.fx.Node | None:
    """The tensor that ``args`` slice along dim 1, all of it and in order; else None."""
    if not args or not all(isinstance(a, torch.fx.Node) and a.target is aten.slice.Tensor
                           and len(a.args) == 4 and a.args[1] == 1 for a in args):
        return None
    base = args[0].args[0]
    end = 0
    for a in args:
        if a.args[0] is not base or a.args[2] != end:
            return None
        end = a.args[3]
    return base if end == _channels(base) else None


def _split_channels(graph: torch.fx.Graph, combined: torch.fx.Node, members: list[torch.fx.Node],
                    widths: list[int]) -> None:
    """Replace each member's uses by its channel slice of ``combined``."""
    combined.meta["channels"] = sum(widths)
    start, previous = 0, combined
    for member, width in zip(members, widths):
        with graph.inserting_after(previous):
            piece = graph.call_function(aten.slice.Tensor, (combined, 1, start, start + width))
        piece.meta["val"] = _val(member)
        member.replace_all_uses_with(piece)
        start, previous = start + width, piece


def _record_and_erase(graph: torch.fx.Graph, report: BatchReport, kind: str, members: list[torch.fx.Node],
                      ops: list[torch.fx.Node]) -> None:
    """The group is rewritten: report it, then drop its members (their uses are replaced)."""
    report.add(kind, members, ops)
    for m in members:
        graph.erase_node(m)


def _op_name(target: Any) -> str:
    return str(target).split(".")[1]  # aten.relu.default -> relu
