"""streamdag over a Ray cluster: the local runtime's API with Ray worker actors as its devices.

``streamdag.ray.Runtime(workers=4)`` makes one worker actor per device, spread over the cluster's
nodes; ``rt.submit`` infers dependencies from the buffers ops read and write, as on one machine;
``rt.record()`` graphs run as one Ray Compiled Graph; ``rt.profile()`` gives one timeline for every
worker. Importing it imports Ray (the ``streamdag[ray]`` extra); nothing else in streamdag does.
"""

from ..errors import WorkerLost
from .compiled import RayGraph, RayGraphResult
from .runtime import RemoteBuffer, Runtime

__all__ = ["RayGraph", "RayGraphResult", "RemoteBuffer", "Runtime", "WorkerLost"]
