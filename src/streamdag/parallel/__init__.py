"""Several devices at once: tensor-parallel linear layers and pipelines, on a runtime's ops and copies."""

from .layers import Block, column_linear, row_linear
from .pipeline import pipeline, place_stages
from .plan import LayerCost, LinkCost, Links, choose_layout, choose_stages, estimate
from .tensor_parallel import LinearChain

__all__ = [
    "Block",
    "LayerCost",
    "LinearChain",
    "LinkCost",
    "Links",
    "choose_layout",
    "choose_stages",
    "column_linear",
    "estimate",
    "pipeline",
    "place_stages",
    "row_linear",
]
