"""From an aten-level fx graph to streamdag ops: what each node reads and writes.

Values in the graph have no memory yet when it is traced, so hazards are
tracked on symbols, as whole-unit regions of two address spaces, and the
ordinary hazard tracker and scheduler apply unchanged:

- ``"sym:value"``: every node writes its own value and reads the values of its
  inputs, so data flow orders producers before consumers;
- ``"sym:storage"``: *symbolic storages*. Every placeholder and every fresh result has
  its own storage id; a view shares the storage of its base (the schema's
  alias sets say which); constants sharing memory share an id. An op reads the
  storages of its tensor arguments and writes those the schema marks
  ``is_write`` (in-place and ``out=`` ops), which orders mutations against
  every other use of the same memory, through views too.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx import GraphModule, Node

from ..graph.buffers import Access, Region

__all__ = ["NodeOp", "ops_from_graph"]

aten = torch.ops.aten

#: ops whose schemas leave out writes they make: in training, these batch norms update the
#: running mean and variance (arguments 3 and 4) in place; argument 5 is the training flag
_UNDECLARED_WRITES = {aten.native_batch_norm.default: ((3, 4), 5),
                      aten.cudnn_batch_norm.default: ((3, 4), 5),
                      aten.miopen_batch_norm.default: ((3, 4), 5)}


@dataclass
class NodeOp:
    """One fx node as a streamdag op."""

    node: Node
    accesses: list[Access]
    run: Callable[[dict], Any]
    writes_inputs: list[int] = field(default_factory=list)
    #: the placeholders and constants (``get_attr``) whose memory it writes, through views too: the
    #: real tensors a run changes (a module's running statistics), which repeated runs must restore
    writes_roots: list[Node] = field(default_factory=list)


def _storage_region(sid: int) -> Region:
    return Region("sym:storage", sid, sid + 1)


def _value_accesses(node: torch.fx.Node, index: dict[torch.fx.Node, int]) -> list[Access]:
    inputs = dict.fromkeys(n for n in _flat_nodes((node.args, node.kwargs)) if n in index)
    acc = [Access(Region("sym:value", index[n], index[n] + 1), False) for n in inputs]
    acc.append(Access(Region("sym:value", index[node], index[node] + 1), True))
    return acc


def _flat_nodes(arg: Any) -> list[torch.fx.Node]:
    out: list[torch.fx.Node] = []
    torch.fx.node.map_arg(arg, out.append)
    return out


def ops_from_graph(
    gm: GraphModule,
) -> tuple[list[NodeOp], list[Node], Any, list[Access]]:
    """Returns ``(ops, placeholders, output_arg, output_reads)`` for the graph's call_function nodes.

    ``output_reads`` are the accesses of an op that gathers the outputs.
    """
    fresh = itertools.count(1)
    storage: dict[torch.fx.Node, Any] = {}  # node -> storage id, or a list of ids for tuples
    by_pointer: dict[int, int] = {}
    placeholders: list[torch.fx.Node] = []
    input_sid: dict[int, int] = {}
    roots: dict[int, torch.fx.Node] = {}  # the storage id of each placeholder and constant: its node
    ops: list[NodeOp] = []
    output_arg: Any = None
    output_reads: list[Access] = []
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            placeholders.append(node)
            storage[node] = next(fresh)
            input_sid[storage[node]] = len(placeholders) - 1
            roots[storage[node]] = node
        elif node.op == "get_attr":
            value = getattr(gm, node.target)
            if isinstance(value, torch.Tensor):
                ptr = value.untyped_storage().data_ptr()
                storage[node] = by_pointer.setdefault(ptr, next(fresh))
                roots.setdefault(storage[node], node)
            else:
                storage[node] = next(fresh)
        elif node.op == "call_function":
            op = _node_op(node, storage, fresh, input_sid)
            op.writes_roots = [roots[a.region.start] for a in op.accesses
                               if a.write and a.region.start in roots]
            op.accesses = _value_accesses(node, index) + op.accesses
            ops.append(op)
        elif node.op == "output":
            output_arg = node.args[0]
            output_reads = [a for a in _value_accesses(node, index) if not a.write]
        else:
            raise NotImplementedError(
                f"fx node {node.format_node()} ({node.op}) is not supported: trace to aten ops "
                "(streamdag.compile does this with make_fx)"
            )
    return ops, placeholders, output_arg, output_reads


def _node_op(node: torch.fx.Node, storage: dict, fresh: Any, input_sid: dict[int, int]) -> NodeOp:
    target = node.target
    if target is operator.getitem:
        base, i = node.args
        sids = storage.get(base)
        storage[node] = sids[i] if isinstance(sids, list) else sids
        return NodeOp(node, [], _runner(node))
    schema = getattr(target, "_schema", None)
    reads: list[int] = []
    writes: list[int] = []
    alias_of: dict[str, int] = {}
    if schema is not None:
        bound = _bind(schema, node)
        for arg, value in bound:
            sids = [storage[n] for n in _flat_nodes(value) if n in storage]
            sids = [s for sub in sids for s in (sub if isinstance(sub, list) else [sub])]
            reads += sids
            info = arg.alias_info
            if info is not None:
                if info.is_write:
                    writes += sids
                for name in info.before_set:
                    if sids:
                        alias_of[name] = sids[0]
        outs = []
        for ret in schema.returns:
            info = ret.alias_info
            shared = [alias_of[n] for n in (info.before_set if info else ()) if n in alias_of]
            outs.append(shared[0] if shared else next(fresh))
        storage[node] = outs[0] if len(outs) == 1 else outs
        writes += _undeclared_writes(node, storage)
    else:  # a Python callable: assume it reads everything it is given and returns new memory
        sids = [storage[n] for n in _flat_nodes((node.args, node.kwargs)) if n in storage]
        reads = [s for sub in sids for s in (sub if isinstance(sub, list) else [sub])]
        storage[node] = next(fresh)
    accesses = [Access(_storage_region(s), False) for s in dict.fromkeys(reads) if s not in writes]
    accesses += [Access(_storage_region(s), True) for s in dict.fromkeys(writes)]
    written_inputs = [input_sid[s] for s in dict.fromkeys(writes) if s in input_sid]
    return NodeOp(node, accesses, _runner(node), written_inputs)


def _undeclared_writes(node: torch.fx.Node, storage: dict) -> list[int]:
    written, flag = _UNDECLARED_WRITES.get(node.target, ((), None))
    if flag is None or not (len(node.args) > flag and node.args[flag]):
        return []
    args = [node.args[i] for i in written if i < len(node.args)]
    sids = [storage[n] for n in _flat_nodes(args) if n in storage]
    return [s for sub in sids for s in (sub if isinstance(sub, list) else [sub])]


def _bind(schema: Any, node: torch.fx.Node) -> list[tuple[Any, Any]]:
    """Pair each schema argument with the value the node passes for it."""
    pairs = []
    positional = list(node.args)
    for i, arg in enumerate(schema.arguments):
        if i < len(positional) and not arg.kwarg_only:
            pairs.append((arg, positional[i]))
        elif arg.name in node.kwargs:
            pairs.append((arg, node.kwargs[arg.name]))
    return pairs


def _runner(node: torch.fx.Node) -> Callable[[dict], Any]:
    """``run(env)`` computes the node from the values in ``env`` and stores its result there.

    Grad mode is per thread and worker lanes start with it on: graphs are inference graphs.
    """
    target, args, kwargs = node.target, node.args, node.kwargs
    map_arg = torch.fx.node.map_arg
    no_grad = torch.no_grad

    def run(env: dict) -> None:
        a = map_arg(args, env.__getitem__)
        k = map_arg(kwargs, env.__getitem__)
        with no_grad():
            env[node] = target(*a, **k)

    return run
