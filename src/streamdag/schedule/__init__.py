"""The pure scheduling layer: plain functions over plain data, no threads, no devices."""

from .dag import check_order, from_edges
from .plan import Schedule, build_schedule
from .waits import Stamp, StreamClocks

__all__ = ["Schedule", "Stamp", "StreamClocks", "build_schedule", "check_order", "from_edges"]
