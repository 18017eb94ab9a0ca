"""A GPU worker's segment of a recorded graph, run as a local streamdag recorded graph.

On a GPU worker the ops of a segment are recorded, on the first run, into a recorded graph of a
local ``streamdag.Runtime("cuda")`` inside the worker, over the worker's buffers (fixed tensors)
and one staging tensor per value the segment receives from other workers. Each run copies the
received values into their staging tensors and runs that graph: from its second run the local
runtime captures it into a CUDA graph and replays it, as it does on one machine. The ops' reads
and writes are the buffers the driver saw declared, so the local schedule keeps the same order.

A run whose segment inherits a failure (an input whose writer failed, or an earlier op of the
worker) cannot replay a graph in part: the worker runs that run's ops one by one instead.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CapturedSegment"]


class CapturedSegment:
    """The local recorded graph of one segment (made on its first run)."""

    def __init__(self, worker: Any, spec: Any) -> None:
        self._worker = worker
        self._spec = spec
        self.graph: Any = None
        self._nodes: list[Any] = []
        self._staging: dict[Any, Any] = {}

    @staticmethod
    def fits(spec: Any) -> bool:
        """Whether a segment can run as one local graph: no value taken from it between its ops."""
        return bool(spec.ops) and not any(op.snapshots for op in spec.ops)

    def run(self, arrived: dict[Any, Any]) -> list[tuple] | None:
        """Each op's result tuple, or None where this run must go op by op (an inherited failure)."""
        import time

        import torch

        from ._worker import Failed, _pack, _result

        worker = self._worker
        if any(type(v) is Failed for v in arrived.values()) or any(
                u in worker.graph_failed for op in self._spec.ops for u in op.fail_if):
            return None
        if self.graph is None:
            self._record(arrived)
        for key, value in arrived.items():
            self._staging[key].copy_(torch.as_tensor(value), non_blocking=False)
        # the copies ran on the default stream, the graph runs on the local runtime's streams
        torch.cuda.synchronize(worker.device)
        t0 = time.time()
        try:
            values = self.graph.run().result()
        except BaseException as e:  # the run's failures: every op of the segment fails with them
            e = e.with_traceback(None)
            for op in self._spec.ops:
                worker.graph_failed[op.index] = (op.name, e)
            now = time.time()
            return [("err", _pack(e), None, t0, t0, now) for _ in self._spec.ops]
        torch.cuda.synchronize(worker.device)
        t1 = time.time()
        return [("ok", _pack(_result(values[node], worker.buffers)), None, t0, t0, t1)
                for node in self._nodes]

    def _record(self, arrived: dict[Any, Any]) -> None:
        import torch

        from ..runtime import Runtime
        from ._worker import Buf, _resolve

        worker = self._worker
        if worker.local is None:
            worker.local = Runtime("cuda")
        self._staging = {key: torch.as_tensor(value).to(worker.device).clone()
                         for key, value in arrived.items()}
        rt = worker.local
        with rt.record() as g:
            for op in self._spec.ops:
                args = _resolve(op.args, worker.buffers, self._staging, worker.name)
                kwargs = _resolve(op.kwargs, worker.buffers, self._staging, worker.name)
                reads = [worker.buffers[b] for b in op.reads] + [self._staging[k] for k in op.incoming]
                writes = [_resolve(Buf(b), worker.buffers, {}, worker.name) for b in op.writes]
                self._nodes.append(rt.submit(op.fn, *args, reads=reads, writes=writes, name=op.name,
                                             **kwargs))
        self.graph = g
