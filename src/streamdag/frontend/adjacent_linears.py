"""Linear layers that read one input and whose weights lie side by side in memory, run as one.

A transformer's query, key and value projections read the same hidden states,
and so do an MLP's gate and up projections. At a decode step (one token per
sequence) each is a matrix-vector product short enough that its launch and its
tail count: on an H200 a Llama-1B layer's three attention projections take 17.4
µs one after another and 6.5 µs as one product over the three weights (a 64
MiB gate/up pair: 21.5 against 18.3 µs). One product needs the weights in one
matrix; copying them into one would double their memory, so the rewrite is made
only where they already are one matrix: each weight starts where the previous
one ends in the same storage (``pack_sibling_linears`` arranges that for a
model, in place).

The rewrite is made on Dynamo's graph, before AOTAutograd, and only where it is
exact:

* the linear layers run without gradients (a product over a view that reaches
  past one weight into the next would give the neighbours no gradient; code that
  turns grad mode on inside is seen in the traced results);
* their weights and biases are parameters or buffers Dynamo holds static, of
  static shapes (an argument tensor may be copied into memory of its own size
  before a captured graph reads it, and its shapes may change from call to call);
* nothing between the first and the last of them may write into memory or switch
  a mode they run under (grad mode, autocast); a higher-order operator (a
  checkpointed body) counts as writing (the one product runs where the first one
  ran); nothing before them may write into their weights or biases, or into a
  value made from them (the one product reads the block where the weights lie);
* where a graph is reused for other modules, their weights are read in place too:
  a captured graph never copies the fused weights (``GraphRunner._static``).

The members' results are slices of the one product, each made contiguous (the
code after them may ``view`` them as it viewed the separate results).

The layout is a fact about the tensors at the compile, not one Dynamo guards:
:class:`AdjacentLayout` checks it again before a call runs the graph (a list
comparison of addresses while they stay those last checked), and a call whose
weights no longer lie so runs the graph as Dynamo traced it, outside any whole-call
graph.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from .candidates import static_indices

__all__ = ["AdjacentLayout", "fuse_adjacent_linears", "pack_sibling_linears"]

_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)

#: children of one module that read one input in the models this recognises (Llama, Mistral, Qwen,
#: Gemma and Phi attention and MLP blocks)
SIBLINGS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass
class AdjacentLayout:
    """Where a graph's fused weights must lie: for each group of weights (and each of biases), the
    indices of the inputs and each one's byte offset in their shared storage."""

    groups: list[tuple[list[int], list[int]]] = field(default_factory=list)
    products: int = 0  # the fused products: one per run of linear layers
    _last_ok: list[int] | None = None

    def add(self, indices: list[int], example_inputs: Sequence[Any]) -> None:
        tensors = [example_inputs[i] for i in indices]
        self.groups.append((indices, [t.data_ptr() - t.untyped_storage().data_ptr() for t in tensors]))

    def holds(self, args: Sequence[Any]) -> bool:
        """Whether every group's tensors among ``args`` still lie as at the compile."""
        ptrs = [args[i].data_ptr() for indices, _ in self.groups for i in indices]
        if ptrs == self._last_ok:
            return True
        for indices, offsets in self.groups:
            storage = args[indices[0]].untyped_storage().data_ptr()
            for i, offset in zip(indices, offsets):
                a = args[i]
                if a.untyped_storage().data_ptr() != storage or a.data_ptr() - storage != offset:
                    return False
        self._last_ok = ptrs
        return True


def _side_by_side(tensors: list[torch.Tensor]) -> bool:
    """Whether each of ``tensors`` (contiguous, one storage) starts where the one before ends."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.device != first.device
                or t.untyped_storage().data_ptr() != storage or t.data_ptr() != end):
            return False
        end = t.data_ptr() + t.numel() * t.element_size()
    return True


def _linear_parts(node: torch.fx.Node) -> tuple[Any, Any, Any] | None:
    if node.op != "call_function" or node.target not in _LINEARS:
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    x = node.kwargs.get("input", args[0])
    weight, bias = node.kwargs.get("weight", args[1]), node.kwargs.get("bias", args[2])
    return None if x is None or weight is None else (x, weight, bias)


_INPLACE_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                      operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
                      operator.ixor, operator.ilshift, operator.irshift, operator.imatmul}


#: the same as methods, as Dynamo may leave them (``call_method`` ``__iadd__``)
_INPLACE_DUNDERS = {f"__{op.__name__}__" for op in _INPLACE_OPERATORS} | {"__delitem__"}
#: parts of the names of the functions by which Dynamo's graph switches a mode the layers run under
_MODE_SWITCHES = ("grad_enabled", "autocast", "inference_mode")


def _arguments(node: torch.fx.Node) -> dict[str, Any]:
    """``node``'s arguments by name where its target's signature says them (``F.relu(x, True)``:
    ``inplace`` is positional), else its keyword arguments."""
    target = node.target
    if node.op == "call_function" and callable(target) and not isinstance(target, torch._ops.OpOverload):
        try:
            return dict(inspect.signature(target).bind(*node.args, **node.kwargs).arguments)
        except (TypeError, ValueError):
            pass
    return dict(node.kwargs)


def _may_write(node: torch.fx.Node) -> bool:
    """Whether ``node`` may write into memory it did not make (an in-place method or function, an
    ``out=`` or ``inplace=True``, a mutable operator, a higher-order operator's body) or switch a mode
    the layers run under (grad mode, autocast): nothing such may run between linear layers the
    rewrite moves together."""
    if node.op in ("placeholder", "output", "get_attr"):
        return False
    if node.op == "call_module":
        return True
    target = node.target
    if isinstance(target, torch._ops.HigherOrderOperator):  # (wrap, checkpoint: a body of its own)
        return True
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    arguments = _arguments(node)
    if arguments.get("out") is not None or arguments.get("inplace") is True:
        return True
    if target in _INPLACE_OPERATORS or name in _INPLACE_DUNDERS or any(s in name for s in _MODE_SWITCHES):
        return True
    if name.endswith("_") and not name.endswith("__"):
        return True
    schema = getattr(target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _written(node: torch.fx.Node) -> list[Any] | None:
    """The nodes whose memory a writing ``node`` (:func:`_may_write`) may write into; None where that
    is not known (a module, a higher-order operator's body, an operator with a mutable schema)."""
    if node.op == "call_module" or isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return None
    arguments = _arguments(node)
    targets = [arguments.get("out")]
    if arguments.get("inplace") is True or node.op == "call_method" or node.target in _INPLACE_OPERATORS or (
            getattr(node.target, "__name__", "").endswith("_")):
        targets.append(node.args[0] if node.args else arguments.get("input"))
    found: list[Any] = []
    torch.fx.node.map_arg(targets, found.append)
    return found


def _derived(sources: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """``sources`` and every node computed from them: all that may be a view of their memory."""
    seen = set(sources)
    todo = list(sources)
    while todo:
        for user in todo.pop().users:
            if user not in seen:
                seen.add(user)
                todo.append(user)
    return seen


def _fusable_inputs(node: torch.fx.Node, example: Any) -> bool:
    """A weight or bias the rewrite may read as part of one block: a parameter or a buffer Dynamo
    holds static (so no captured graph copies it into memory of its own size), of static shape."""
    if not isinstance(example, torch.Tensor) or not static_indices([example]):
        return False
    val = node.meta.get("example_value")
    return isinstance(val, torch.Tensor) and all(type(d) is int for d in val.shape)


def fuse_adjacent_linears(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> AdjacentLayout:
    """Rewrite ``gm`` (Dynamo's graph) in place: linear layers over one input whose weights (and
    biases) are graph inputs lying side by side become one (see the module docstring). The layout
    the rewritten graph needs; no groups where nothing was rewritten."""
    layout = AdjacentLayout()
    if torch.is_grad_enabled():
        return layout
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    by_input: dict[Any, list[tuple[torch.fx.Node, int, int | None]]] = {}
    for node in gm.graph.nodes:
        parts = _linear_parts(node)
        if parts is None:
            continue
        x, weight, bias = parts
        if weight not in placeholders or (bias is not None and bias not in placeholders):
            continue
        out = node.meta.get("example_value")
        if not isinstance(out, torch.Tensor) or out.requires_grad:  # (grad mode turned on in the code)
            continue
        w = example_inputs[placeholders[weight]]
        if not _fusable_inputs(weight, w) or w.dim() != 2 or (
                bias is not None and not _fusable_inputs(bias, example_inputs[placeholders[bias]])):
            continue
        by_input.setdefault(x, []).append((node, placeholders[weight],
                                           None if bias is None else placeholders[bias]))
    runs = [run for members in by_input.values() for run in _runs(members, example_inputs)]
    if not runs:  # (most graphs: the scan for writes below binds each call's arguments)
        return layout
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    writers = [n for n in gm.graph.nodes if _may_write(n)]
    written = {w: _written(w) for w in writers}
    for run in runs:
        first = min((m[0] for m in run), key=order.__getitem__)
        last = max(order[m[0]] for m in run)
        if any(order[first] < order[w] < last for w in writers):  # something written between them
            continue
        # nor may anything before them write into their weights or biases: the one product reads the
        # block where they lie, while the graph as traced reads what such a write made
        before = [written[w] for w in writers if order[w] < order[first]]
        if before:
            params = [p for node, _, _ in run for p in _linear_parts(node)[1:] if p is not None]  # type: ignore[index]
            weights = _derived(params)
            if any(targets is None or weights.intersection(targets) for targets in before):
                continue
        _rewrite(gm, run, first, example_inputs, layout)
    if layout.groups:
        gm.graph.lint()
        gm.recompile()
    return layout


def _runs(members: list[tuple[torch.fx.Node, int, int | None]],
          example_inputs: Sequence[Any]) -> list[list[tuple[torch.fx.Node, int, int | None]]]:
    """The maximal runs (two or more) of ``members`` whose weights, in memory order, lie side by side,
    with their biases likewise or none at all."""
    members = sorted(members, key=lambda m: example_inputs[m[1]].data_ptr())
    runs: list[list[tuple[torch.fx.Node, int, int | None]]] = []
    current: list[tuple[torch.fx.Node, int, int | None]] = []

    def fits(run: list[tuple[torch.fx.Node, int, int | None]]) -> bool:
        weights = [example_inputs[m[1]] for m in run]
        if len({w.shape[1] for w in weights}) != 1 or not _side_by_side(weights):
            return False
        biases = [m[2] for m in run]
        if all(b is None for b in biases):
            return True
        return None not in biases and _side_by_side([example_inputs[b] for b in biases])  # type: ignore[index]

    for m in members:
        if current and fits([*current, m]):
            current.append(m)
            continue
        if len(current) > 1:
            runs.append(current)
        current = [m]
    if len(current) > 1:
        runs.append(current)
    return runs


def _rewrite(gm: torch.fx.GraphModule, run: list[tuple[torch.fx.Node, int, int | None]], first: torch.fx.Node,
             example_inputs: Sequence[Any], layout: AdjacentLayout) -> None:
    """One product in place of ``run``'s linear layers, where ``first`` of them ran."""
    graph = gm.graph
    weights = [example_inputs[m[1]] for m in run]
    rows = [w.shape[0] for w in weights]
    x, weight0, bias0 = _linear_parts(run[0][0])  # type: ignore[misc]
    layout.add([m[1] for m in run], example_inputs)
    layout.products += 1
    w0 = weights[0]
    with graph.inserting_before(first):
        whole = graph.call_function(torch.as_strided, (weight0, (sum(rows), w0.shape[1]), (w0.shape[1], 1),
                                                       w0.storage_offset()))
        bias = None
        if bias0 is not None:
            offset = example_inputs[run[0][2]].storage_offset()  # type: ignore[index]
            bias = graph.call_function(torch.as_strided, (bias0, (sum(rows),), (1,), offset))
            layout.add([m[2] for m in run], example_inputs)  # type: ignore[misc]
        product = graph.call_function(torch._C._nn.linear, (x, whole, bias))
        pieces = graph.call_function(torch.split, (product, rows), {"dim": -1})
        for k, (node, _, _) in enumerate(run):
            piece = graph.call_function(operator.getitem, (pieces, k))
            node.replace_all_uses_with(graph.call_method("contiguous", (piece,)))
    for node, _, _ in run:
        graph.erase_node(node)


def pack_sibling_linears(model: torch.nn.Module, siblings: Sequence[Sequence[str]] = SIBLINGS) -> int:
    """Put the weights (and biases) of each module's sibling projections (``siblings``: child names
    that read one input, such as ``q_proj``, ``k_proj``, ``v_proj``) side by side in one storage, in
    place: each parameter keeps its object and values, its ``.data`` becomes a slice of the packed
    tensor, and the old memory goes. Where PyTorch does not let an inference tensor's ``.data`` be
    replaced, its layer gets a new parameter over its slice, without gradients, as inference
    tensors can have none. Siblings already side by side, of other input sizes, dtypes or
    devices, with biases on some only, or of a subclass of ``Linear`` or ``Parameter`` (quantized
    layers keep state a concatenation would lose) are left. How many groups were packed."""
    from torch.nn.utils.parametrize import is_parametrized

    packed = 0
    with torch.no_grad():
        for module in model.modules():
            for names in siblings:
                layers = [getattr(module, n, None) for n in names]
                # plain layers and tensors only: a subclass (a quantized layer, a tensor subclass's
                # weight) keeps state that a concatenation would lose
                if not all(type(layer) is torch.nn.Linear and not is_parametrized(layer)
                           and type(layer.weight) is torch.nn.Parameter for layer in layers):
                    continue
                weights = [layer.weight for layer in layers]  # type: ignore[union-attr]
                biases = [layer.bias for layer in layers]  # type: ignore[union-attr]
                has_bias = [b is not None for b in biases]
                if any(has_bias) and not all(has_bias):
                    continue
                if len({(w.shape[1], w.dtype, w.device) for w in weights}) != 1 or any(
                        w.device.type == "meta" for w in weights):
                    continue
                if _side_by_side(weights) and (not all(has_bias) or _side_by_side(biases)):  # type: ignore[arg-type]
                    continue
                for name, params in (("weight", weights), ("bias", biases)) if all(has_bias) else (
                        ("weight", weights),):
                    _pack(layers, name, params)  # type: ignore[arg-type]
                packed += 1
    return packed


def _pack(layers: list[Any], name: str, params: list[torch.nn.Parameter]) -> None:
    """The ``name`` parameters of ``layers`` (``params``) made slices of one new tensor."""
    inference = any(p.is_inference() for p in params)
    with torch.inference_mode(inference):
        whole = torch.cat([p.detach() for p in params])
    for layer, p, part in zip(layers, params, whole.split([p.shape[0] for p in params])):
        try:
            p.data = part
        except RuntimeError:  # (an inference tensor's, on PyTorch versions that refuse it)
            setattr(layer, name, torch.nn.Parameter(part, requires_grad=False))
