"""The few array kernels the parallel helpers need, for torch tensors and for simulated devices.

The helpers only ever write into buffers they allocated up front, so a
recorded graph of them holds the same memory on every run.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Kernels", "kernels_for"]


class Kernels:
    """Kernels over torch tensors (GPU or CPU)."""

    @staticmethod
    def empty(rows: int, cols: int, like: Any, device: str) -> Any:
        from ..runtime.peers import empty_tensor

        return empty_tensor((rows, cols), like.dtype, device)

    @staticmethod
    def block(w: Any, rows: slice, cols: slice, device: str) -> Any:
        """A contiguous copy of ``w[rows, cols]`` on ``device`` (done once, when a layer is built)."""
        return w[rows, cols].contiguous().to(device)

    @staticmethod
    def mm_into(out: Any, a: Any, b: Any) -> Any:
        import torch

        return torch.mm(a, b, out=out)

    @staticmethod
    def addmm_into(out: Any, a: Any, b: Any) -> Any:
        return out.addmm_(a, b)

    @staticmethod
    def add_into(out: Any, a: Any) -> Any:
        return out.add_(a)

    @staticmethod
    def relu_(x: Any) -> Any:
        return x.relu_()

    @staticmethod
    def device_of(x: Any) -> str:
        return "cpu" if x.device.type == "cpu" else f"cuda:{x.device.index or 0}"

    @staticmethod
    def view(m: Any, r0: int, r1: int, c0: int, c1: int | None) -> Any:
        return m[r0:r1, c0:c1]

    @staticmethod
    def clone(x: Any) -> Any:
        return x.clone()


class SimKernels:
    """The same kernels over arrays of simulated devices, for tests on the CPU."""

    @staticmethod
    def empty(rows: int, cols: int, like: Any, device: str) -> Any:
        from ..backends.sim import SimArray

        return SimArray(np.empty((rows, cols), dtype=like.data.dtype), device)

    @staticmethod
    def block(w: Any, rows: slice, cols: slice, device: str) -> Any:
        from ..backends.sim import SimArray

        return SimArray(np.ascontiguousarray(w.data[rows, cols]), device)

    @staticmethod
    def mm_into(out: Any, a: Any, b: Any) -> Any:
        np.matmul(a.data, b.data, out=out.data)
        return out

    @staticmethod
    def addmm_into(out: Any, a: Any, b: Any) -> Any:
        out.data += a.data @ b.data
        return out

    @staticmethod
    def add_into(out: Any, a: Any) -> Any:
        out.data += a.data
        return out

    @staticmethod
    def relu_(x: Any) -> Any:
        np.maximum(x.data, 0, out=x.data)
        return x

    @staticmethod
    def device_of(x: Any) -> str:
        return x.device

    @staticmethod
    def view(m: Any, r0: int, r1: int, c0: int, c1: int | None) -> Any:
        from ..backends.sim import SimArray

        view = SimArray.__new__(SimArray)
        view.data, view.device = m.data[r0:r1, c0:c1], m.device
        return view

    @staticmethod
    def clone(x: Any) -> Any:
        from ..backends.sim import SimArray

        return SimArray(x.data.copy(), x.device)


def kernels_for(x: Any) -> Any:
    return SimKernels if hasattr(x, "streamdag_space") else Kernels
