"""Several devices at once: tensor-parallel linear layers and pipelines, on a runtime's ops and copies."""

from .pipeline import pipeline, place_stages
from .plan import LayerCost, LinkCost, Links, choose_layout, choose_stages, estimate
from .tensor_parallel import Block, LinearChain, column_linear, row_linear

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
