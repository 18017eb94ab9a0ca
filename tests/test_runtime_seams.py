"""The runtime's modules meet the runtime through the interfaces they declare.

``core.Runtime`` is composed of its parts (``submitting``, ``held``, ``completion``,
``lifecycle``), which share its state. Every other module of ``streamdag.runtime`` that is handed
a runtime declares what it needs of it as a ``typing.Protocol`` (``ReplayRuntime``,
``CopyRuntime``, ...): it reads no private name of the runtime that its protocol does not list,
and a runtime has every member each protocol lists, on both paths (compiled and Python).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from typing import Any, Protocol

import pytest

import streamdag as sd
from streamdag import runtime as runtime_package

#: the parts ``Runtime`` is made of: their ``self`` is the runtime
PARTS = {"core", "submitting", "held", "completion", "lifecycle"}
#: the names a runtime goes by in the other modules (``graph._rt``: a recorded graph's)
RUNTIME_NAMES = {"rt", "runtime"}


def _modules() -> list[Any]:
    names = sorted(m.name for m in pkgutil.iter_modules(runtime_package.__path__) if m.name not in PARTS)
    return [importlib.import_module(f"streamdag.runtime.{name}") for name in names]


def _private_runtime_reads(module: Any) -> set[str]:
    """The private names the module reads on a runtime: ``rt._x``, ``runtime._x``, ``<anything>._rt._x``."""
    found = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in RUNTIME_NAMES) or (
                    isinstance(owner, ast.Attribute) and owner.attr == "_rt"):
                found.add(node.attr)
    return found


def _declared(module: Any) -> tuple[str | None, set[str]]:
    """The module's runtime protocol (a Protocol named ``*Runtime`` defined there) and its members,
    its own and those of the protocols it extends."""
    for name, value in vars(module).items():
        if (inspect.isclass(value) and value.__module__ == module.__name__ and name.endswith("Runtime")
                and issubclass(value, Protocol) and value is not Protocol):  # type: ignore[arg-type]
            members: set[str] = set()
            for cls in value.__mro__:
                if cls in (Protocol, object) or not getattr(cls, "_is_protocol", False):
                    continue
                members |= set(inspect.get_annotations(cls))  # (each member is annotated)
            return name, members
    return None, set()


@pytest.mark.parametrize("module", _modules(), ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_a_runtime_module_reads_only_the_private_runtime_members_its_protocol_declares(module):
    reads = _private_runtime_reads(module)
    protocol, members = _declared(module)
    if reads and protocol is None:
        pytest.fail(f"{module.__name__} reads {sorted(reads)} of a runtime but declares no "
                    "Protocol named *Runtime listing what it needs")
    undeclared = reads - members
    assert not undeclared, f"{module.__name__} reads {sorted(undeclared)} of a runtime, not in {protocol}"


def test_the_protocols_are_found_where_the_modules_read_private_runtime_names():
    """The check above can fail: the modules that read the runtime's private names have protocols."""
    by_name = {m.__name__.rsplit(".", 1)[-1]: m for m in _modules()}
    for name in ("replay", "transfers", "recorded", "graph_runs", "peers", "streaming", "capture"):
        assert _private_runtime_reads(by_name[name]), name
        assert _declared(by_name[name])[0] is not None, name


def test_a_runtime_has_every_member_the_modules_declare_they_need(path):
    with sd.Runtime("cpu", streams=2) as rt:
        for module in _modules():
            protocol, members = _declared(module)
            missing = sorted(name for name in members if not hasattr(rt, name))
            assert not missing, f"a Runtime lacks {missing} of {module.__name__}.{protocol}"
