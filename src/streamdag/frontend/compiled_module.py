"""What ``streamdag.compile`` returns for a ``torch.nn.Module``: :class:`CompiledModule`, a
:class:`~.compiled_model.CompiledModel` that is a module too and stands for the model it wraps."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, cast

import torch

from .._diagnostics import warn
from .compiled_model import CompiledModel
from .inductor_backend import StreamdagBackend

__all__ = ["CompiledModule"]

#: what nn.Module's constructor sets on a module
_MODULE_STATE = vars(torch.nn.Module())
#: nn.Module's dicts and sets, which a compiled module shares with its model (one object each)
_SHARED = frozenset(name for name, value in _MODULE_STATE.items() if isinstance(value, (dict, set)))
#: the compiled call's own attributes; any other set on a compiled module is set on the wrapped model
_CALLS_OWN = frozenset(
    {"backend", "__wrapped__", "_settings", "_compiled", "_compiled_symbolic", "_compile_calls",
     "_grad_static_keys", "_hook_root", "_hook_watch", "_hook_compiles", "_wrappers_by_hooks",
     "_wrapper_hooks", "_as_written", "_first_call", "_called", "whole"})
#: the attributes a compiled module keeps for itself
_OWN_ATTRIBUTES = _CALLS_OWN | set(_MODULE_STATE)

#: torch.nn.Module's methods a compiled module answers itself (the others run on the wrapped model)
_ANSWERED_HERE = frozenset({"forward", "train", "eval", "compile", "_call_impl", "_wrapped_call_impl",
                            "_slow_forward"})

_REWRITE_THE_MODEL = (
    "a compiled module stands for its model and cannot take a rewrite of the model's class "
    "(torch.nn.utils.parametrize): apply it to the model before compiling, or to compiled.__wrapped__, "
    "the model itself")


class CompiledModule(CompiledModel, torch.nn.Module):
    """What ``streamdag.compile`` returns for a ``torch.nn.Module``: a :class:`CompiledModel` that is
    a module too, so that it takes a module's place (``parent.encoder = streamdag.compile(
    parent.encoder)``, an ``nn.Sequential`` of compiled parts) as ``torch.compile``'s wrapper does.

    It stands for the wrapped model, not beside it: ``nn.Module``'s methods run on the wrapped model
    (one that returns the model returns this compiled module), its parameter, buffer, submodule and
    hook dicts are the model's own objects, and an attribute set or deleted on it is set on the
    model, which the compiled code then follows (Dynamo's guards, the whole-call graphs' state
    check). So a parent's ``state_dict()``, ``parameters()``, ``to()`` and ``load_state_dict()`` see
    the model's names, with no prefix of the wrapper's, and its ``modules()`` the model itself in
    the wrapper's place (``isinstance`` walks, and streamdag's own state checks of a compiled
    parent, read the model's attributes, not the wrapper's); ``nn.DataParallel``'s replicas, made
    from ``modules()``, run the model uncompiled. Only the attributes of the compiled call itself
    (:data:`_OWN_ATTRIBUTES`) are the wrapper's.
    """

    def __init__(self, fn: torch.nn.Module, backend: StreamdagBackend,
                 settings: dict[str, Any] | None = None) -> None:
        torch.nn.Module.__init__(self)  # (first: its training flag goes nowhere while no model is set)
        for name in _SHARED:  # the model's dicts, one object each
            object.__setattr__(self, name, getattr(fn, name))
        CompiledModel.__init__(self, fn, backend, settings)
        shadowed = _shadowed(fn)
        if shadowed:
            names = ", ".join(shadowed)
            warn(f"streamdag.compile: {type(fn).__name__} has attributes the compiled module keeps for "
                 f"itself ({names}): compiled.<name> reads and sets the compiled module's; reach the "
                 f"model's through compiled.__wrapped__.<name>")

    @property  # type: ignore[override]
    def training(self) -> bool:
        wrapped = self.__dict__.get("__wrapped__")
        return True if wrapped is None else wrapped.training

    @training.setter
    def training(self, mode: bool) -> None:
        wrapped = self.__dict__.get("__wrapped__")
        if wrapped is not None:
            wrapped.training = mode

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "__class__":  # (torch.nn.utils.parametrize: a class of the model's own, made
            raise TypeError(_REWRITE_THE_MODEL)  # for it, would become the wrapper's)
        if name in _SHARED and "__wrapped__" in self.__dict__ and isinstance(value, (dict, set)):
            # (``compiled._forward_hooks = OrderedDict()``): the model's own object takes the new
            # contents, so that it stays the one object the wrapper shares and the hook watch sees
            shared = getattr(self.__wrapped__, name)
            shared.clear()
            shared.update(value)
        elif name in _OWN_ATTRIBUTES or "__wrapped__" not in self.__dict__:
            object.__setattr__(self, name, value)
        else:
            setattr(self.__wrapped__, name, value)

    def __delattr__(self, name: str) -> None:
        if name in _OWN_ATTRIBUTES:
            object.__delattr__(self, name)
        else:
            delattr(self.__wrapped__, name)

    @property
    def parametrizations(self) -> Any:
        """The model's, to read (none, an ``AttributeError``, where the model has none: ``hasattr``,
        ``parametrize.is_parametrized`` and quantization's walks read it so). Refused to
        ``torch.nn.utils.parametrize``'s ``register_parametrization`` and
        ``remove_parametrizations``, which rewrite the module's class, here the wrapper's: they
        read this first, so they stop before they change anything (they delete the tensor they
        parametrize before they rewrite the class)."""
        if _read_by_parametrize():
            raise TypeError(_REWRITE_THE_MODEL)
        wrapped = self.__dict__.get("__wrapped__")
        found = getattr(wrapped, "parametrizations", None) if wrapped is not None else None
        if found is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute 'parametrizations'")
        return found

    # A container model's protocol (nn.Sequential, ModuleList, ModuleDict) is the model's too:
    # indexing gives its parts (uncompiled), as ``compiled.encoder`` does; truth follows the model
    # (an empty Sequential is false, a module without a length true)
    def __len__(self) -> int:
        return len(cast(Any, self.__wrapped__))

    def __getitem__(self, index: Any) -> Any:
        return cast(Any, self.__wrapped__)[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(cast(Any, self.__wrapped__))

    def __contains__(self, item: Any) -> bool:
        return item in cast(Any, self.__wrapped__)

    def __bool__(self) -> bool:
        return bool(cast(Any, self.__wrapped__))

    #: a call through ``nn.Module.__call__``'s own path (a parent's ``_call_impl`` reached some
    #: other way) is the compiled call too: the model then runs its hooks once, not the wrapper too
    _call_impl = CompiledModel.__call__
    _wrapped_call_impl = CompiledModel.__call__

    def __dir__(self) -> list[str]:
        return sorted(set(dir(type(self))) | set(dir(self.__wrapped__)))

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Refused: the model is compiled already (``nn.Module.compile`` would put ``torch.compile``
        under streamdag's compiled call, on the wrapped model's own calls)."""
        raise TypeError("this model is compiled by streamdag.compile already; to compile it otherwise, "
                        "call .compile() (or torch.compile) on the model it wraps, compiled.__wrapped__")


def _read_by_parametrize() -> bool:
    """Whether ``torch.nn.utils.parametrize``'s register or remove call reads the attribute: its
    frames' code, a few frames up (``is_parametrized``'s ``getattr``, called by them), told from
    any other reader's. The frames are read because both call sites probe with
    ``getattr(module, "parametrizations", None)``, which also answers ``hasattr``-style probes."""
    from torch.nn.utils import parametrize

    rewrites = {parametrize.register_parametrization.__code__, parametrize.remove_parametrizations.__code__}
    frame: FrameType | None = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code in rewrites:
            return True
        frame = frame.f_back
    return False


def _shadowed(model: torch.nn.Module) -> list[str]:
    """The model's attributes that a compiled module's own hide (:data:`_SHADOWING`)."""
    return sorted(n for n in _SHADOWING if n in vars(model) or hasattr(type(model), n))


def _run_on_the_model(name: str) -> Callable[..., Any]:
    def method(self: CompiledModule, *args: Any, **kwargs: Any) -> Any:
        wrapped = self.__wrapped__
        out = getattr(wrapped, name)(*args, **kwargs)
        return self if out is wrapped else out
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"The wrapped model's ``{name}`` (this compiled module where that returns the model)."
    return method


for _name, _value in vars(torch.nn.Module).items():
    if callable(_value) and not _name.startswith("__") and _name not in _ANSWERED_HERE:
        setattr(CompiledModule, _name, _run_on_the_model(_name))

#: the names whose compiled module's attribute hides the model's: the compiled call's state and its
#: methods (``explain``, ``statistics``...), but for those ``nn.Module`` has itself
_SHADOWING = frozenset(
    (_CALLS_OWN | {n for n in dir(CompiledModule) if not n.startswith("_")})
    - set(dir(torch.nn.Module)) - {"__wrapped__", "training", "parametrizations"})  # (the model's)
