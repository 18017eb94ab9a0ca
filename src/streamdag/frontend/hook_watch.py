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
from collections.abc import Iterable
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
    """A snapshot of the hooks of ``root`` and its submodules. :meth:`unchanged` says at once that
    no hook dict and no submodule dict changed (their version tags, where the compiled module has
    them; else their lengths, keys and values, in Python: about 150 ns per submodule), and
    :meth:`moved` then says whether the hooks the model runs differ from the snapshot's: every
    hook dict that holds any, by identity, with its keys. A submodule put in another's place
    without hooks moves none; one put in with hooks does."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = root
        self.take()

    def take(self) -> None:
        """Snapshot the hooks and the submodules as they are now."""
        modules = list(self.root.modules())
        self._hooks = self._hook_dicts(modules)
        self._lengths = tuple(map(len, self._hooks))
        self._keys = [(d, tuple(d)) for d in self._hooks if d]
        self._signature = self._signature_of(self._hooks)
        self._children = [d for m in modules if isinstance(d := m.__dict__.get("_modules"), dict)]
        self._child_lengths = tuple(map(len, self._children))
        self._child_values = tuple(itertools.chain.from_iterable(map(dict.values, self._children)))
        self._all = [*self._hooks, *self._children]
        self._native = dict_tags()
        self._tags = self._native.dict_versions(self._all) if self._native is not None else None

    @staticmethod
    def _hook_dicts(modules: Iterable[torch.nn.Module]) -> list[dict[Any, Any]]:
        return [d for m in modules for kind in _KINDS
                if isinstance(d := m.__dict__.get(kind), dict)] + _global_hooks()

    @staticmethod
    def _signature_of(hooks: list[dict[Any, Any]]) -> frozenset[tuple[int, tuple[Any, ...]]]:
        return frozenset((id(d), tuple(d)) for d in hooks if d)

    def unchanged(self) -> bool:
        """Whether no dict of the snapshot changed (a change may still leave the hooks as they were)."""
        if self._tags is not None:
            return self._native.same_dict_versions(self._all, self._tags)
        return (tuple(map(len, self._hooks)) == self._lengths
                and all(tuple(d) == keys for d, keys in self._keys)
                and tuple(map(len, self._children)) == self._child_lengths
                and all(map(operator.is_, itertools.chain.from_iterable(map(dict.values, self._children)),
                            self._child_values)))

    def moved(self) -> bool:
        """Whether the hooks the model runs now differ from the snapshot's (a walk of the model)."""
        return self.signature_now() != self._signature

    @property
    def signature(self) -> frozenset[tuple[int, tuple[Any, ...]]]:
        """The snapshot's hooks: each hook dict that held any, by identity, with its keys (hook
        handles' ids, never reused: a hook removed and another added is another signature)."""
        return self._signature

    def signature_now(self) -> frozenset[tuple[int, tuple[Any, ...]]]:
        """The hooks the model runs now, as :attr:`signature` gives the snapshot's."""
        return self._signature_of(self._hook_dicts(self.root.modules()))
