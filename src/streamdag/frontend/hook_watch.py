"""Whether a model's module hooks are the ones it had at a snapshot (:class:`HookWatch`).

Dynamo does not guard module hooks (PyTorch's default,
``torch._dynamo.config.skip_nnmodule_hook_guards``, which ``torch.compile`` keeps too): a forward
or backward hook registered after the model's code was compiled would not run. A compiled model
compares its hooks with a snapshot before each call on Dynamo's path and compiles again where they
moved (:class:`~streamdag.frontend.compiled_model.CompiledModel`); Dynamo's own guards on hooks
cost about 1.2 µs per submodule at every call, the snapshot's version tags under a microsecond
for 150 submodules.

State: ``_hooks``, every submodule's forward, forward-pre, backward and backward-pre hook dicts
and PyTorch's global ones, with their lengths and the keys (hook handles' ids, never reused) of
those that held any; ``_children``, every submodule's ``_modules`` dict with its values, so that a
submodule put in another's place (whose own hooks the snapshot lacks) is noticed. Invariant:
both describe the module as it was at the last :meth:`HookWatch.take`.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch

from .state_watch import dict_tags

__all__ = ["HookWatch"]

_KINDS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _global_hooks() -> list[dict[Any, Any]]:
    """PyTorch's hooks for every module (``register_module_forward_hook`` and the like)."""
    module = torch.nn.modules.module
    names = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
             "_global_backward_pre_hooks")
    return [d for name in names if isinstance(d := getattr(module, name, None), dict)]


class HookWatch:
    """A snapshot of the hooks of ``root`` and its submodules; :meth:`unchanged` says at once that
    none moved (the dicts' version tags, where the compiled module has them), and otherwise
    :meth:`hooks_hold` and :meth:`children_hold` say whether they are as they were (in Python,
    about 150 ns per submodule for the two)."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = root
        self.take()

    def take(self) -> None:
        """Snapshot the hooks and the submodules as they are now."""
        modules = list(self.root.modules())
        self._hooks = [d for m in modules for kind in _KINDS
                       if isinstance(d := m.__dict__.get(kind), dict)] + _global_hooks()
        self._lengths = tuple(map(len, self._hooks))
        self._keys = [(d, tuple(d)) for d in self._hooks if d]
        self._children = [d for m in modules if isinstance(d := m.__dict__.get("_modules"), dict)]
        self._child_lengths = tuple(map(len, self._children))
        self._child_values = tuple(itertools.chain.from_iterable(map(dict.values, self._children)))
        self._all = [*self._hooks, *self._children]
        self.retag()

    def retag(self) -> None:
        """Take the dicts' version tags again (after a change that left them as they were)."""
        self._native = dict_tags()
        self._tags = self._native.dict_versions(self._all) if self._native is not None else None

    def unchanged(self) -> bool:
        """Whether no dict of the snapshot changed at all (their version tags, compiled: a few ns a
        dict); False where it cannot tell, so that :meth:`hooks_hold` and :meth:`children_hold` look."""
        return self._tags is not None and self._native.same_dict_versions(self._all, self._tags)

    def hooks_hold(self) -> bool:
        """Whether every hook dict of the snapshot holds the hooks it held."""
        return (tuple(map(len, self._hooks)) == self._lengths
                and all(tuple(d) == keys for d, keys in self._keys))

    def children_hold(self) -> bool:
        """Whether every submodule of the snapshot has the submodules it had."""
        return (tuple(map(len, self._children)) == self._child_lengths
                and all(map(operator.is_, itertools.chain.from_iterable(map(dict.values, self._children)),
                            self._child_values)))
