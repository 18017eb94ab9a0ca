"""The runtime layer: drives backends from schedules; futures, bounds, failures."""

from .core import Runtime, RuntimeStatistics
from .ops import Future
from .recorded import GraphResult, OpNode, RecordedGraph

__all__ = ["Future", "GraphResult", "OpNode", "RecordedGraph", "Runtime", "RuntimeStatistics"]
