"""``torch.compile(model, backend="streamdag")``: Dynamo hands each captured graph to streamdag.

Registered through the ``torch_dynamo_backends`` entry point, so installing
streamdag is enough; importing this module registers it too. Graph breaks are
Dynamo's: every piece it captures becomes one :class:`~streamdag.frontend.Compiled`.
"""

from __future__ import annotations

from typing import Any

import torch

from .compiled import Compiled

__all__ = ["streamdag_backend"]


def streamdag_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """Trace to aten ops at the first real call (the examples Dynamo passes may be fake tensors).

    The module state is Dynamo's to guard: its graph takes parameters and buffers as inputs and
    has the training flag and Python attributes baked in, and it recompiles when they change.
    """
    return Compiled(gm, guard_module=False)


try:
    from torch._dynamo import register_backend

    if "streamdag" not in torch._dynamo.list_backends(exclude_tags=()):
        register_backend(name="streamdag")(streamdag_backend)
except Exception:  # pragma: no cover - very old or stripped builds of torch
    pass
