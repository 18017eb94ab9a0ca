"""The graph layer: memory regions, accesses and the hazards between them. Pure."""

from .buffers import Access, Marker, Region, read, region_of, write
from .hazards import DepsTracker

__all__ = ["Access", "DepsTracker", "Marker", "Region", "read", "region_of", "write"]
