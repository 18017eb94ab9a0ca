"""Several devices at once: tensor-parallel linear layers and pipelines, on a runtime's ops and copies."""

from .pipeline import pipeline
from .plan import LayerCost, LinkCost, Links, choose_layout, estimate
from .tensor_parallel import Block, LinearChain, column_linear, row_linear

__all__ = [
    "Block",
    "LayerCost",
    "LinearChain",
    "LinkCost",
    "Links",
    "choose_layout",
    "column_linear",
    "estimate",
    "pipeline",
    "row_linear",
]
