"""``torch.compile(model, backend="streamdag")``: Dynamo hands each captured graph to streamdag.

Registered through the ``torch_dynamo_backends`` entry point, so installing
streamdag is enough; importing this module registers it too. Graph breaks are
Dynamo's: every piece it captures goes to
:func:`~streamdag.frontend.inductor_backend.default_backend` (Inductor's
kernels on streamdag's streams; one backend per process, and one per set of
Inductor settings passed as ``options``), or, with
``STREAMDAG_COMPILE_ENGINE=aten``, becomes one
:class:`~streamdag.frontend.Compiled` (the make_fx path).
"""

from __future__ import annotations

from typing import Any

import torch

from .compiled import Compiled

__all__ = ["streamdag_backend"]


def streamdag_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], *,
                      options: dict[str, Any] | None = None, mode: str | None = None) -> Any:
    """Inductor's kernels on streamdag's streams; the make_fx path where the engine says ``aten``.

    ``options`` (``torch.compile(..., options={...})``) are Inductor settings by name, as for
    Inductor's own backend. On the make_fx path the module state is Dynamo's to guard: its graph
    takes parameters and buffers as inputs and has the training flag and Python attributes baked
    in, and it recompiles when they change.
    """
    from .inductor_backend import default_backend, engine_from

    if mode is not None:
        raise TypeError(f"torch.compile(backend='streamdag') takes no mode (got mode={mode!r}): streamdag "
                        "chooses streams and CUDA graphs itself; pass Inductor settings as "
                        "options={...}, e.g. options={'max_autotune': True}")
    if engine_from(None) == "aten":  # traced to aten ops at the first real call (examples may be fake)
        if options:
            raise TypeError("options are Inductor settings: the make_fx path (STREAMDAG_COMPILE_ENGINE=aten) "
                            "has no Inductor; unset the variable or drop options")
        return Compiled(gm, guard_module=False)
    return default_backend(options)(gm, example_inputs)


try:
    from torch._dynamo import register_backend

    if "streamdag" not in torch._dynamo.list_backends(exclude_tags=()):
        register_backend(name="streamdag")(streamdag_backend)
except Exception:  # pragma: no cover - very old or stripped builds of torch
    pass
