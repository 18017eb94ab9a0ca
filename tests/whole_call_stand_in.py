"""A stand-in for a whole call's CUDA calls on the CPU, shared by the whole-call tests.

:class:`FakeDevice` "replays" by computing the model eagerly into the captured
outputs, so the key, the state checks, the choice between replaying and
Dynamo's path, and what the caller gets back are checked without a GPU;
:class:`Dynamo` stands for Dynamo's path and counts its calls.
"""

import torch
from torch import nn
from torch.utils import _pytree as pytree

from stand_in_device import StandInDevice
from streamdag.frontend import whole_call as wc
from streamdag.frontend.result_objects import template
from streamdag.frontend.whole_call import WholeCall

#: the two ways to run without gradients, each a whole call's key of its own
MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


class FakeGraph:
    def __init__(self, replay):
        self.replay = replay


def tensors_of(result):
    """Every distinct tensor of a result, those inside plain objects (a cache) too, in the order
    ``result_parts`` gives them: what a graph writes."""
    found = {}
    for leaf in pytree.tree_leaves(result):
        if isinstance(leaf, torch.Tensor):
            found.setdefault(id(leaf), leaf)
        else:
            template(leaf, lambda t: found.setdefault(id(t), t) is None or 0)
    return list(found.values())


class FakeDevice(StandInDevice):
    """A replay computes ``eager`` into the captured outputs."""

    def __init__(self, eager):
        super().__init__()
        self.eager = eager
        self.fail = None

    def capture(self, fn, args, kwargs, private=False):
        buffers = list(self.eager.buffers()) if isinstance(self.eager, nn.Module) else []
        saved = [b.clone() for b in buffers]
        out = fn(*args, **kwargs)
        with torch.no_grad():  # a capture runs nothing: what the call updated in place stays as it was
            for b, s in zip(buffers, saved):
                b.copy_(s)
        if self.fail:  # as CUDA's capture fails: at its end
            raise RuntimeError(self.fail)

        modules = list(self.eager.modules()) if isinstance(self.eager, nn.Module) else []
        modes = [m.training for m in modules]

        def replay():  # what the call computed at the capture: in the modules' modes of then
            self.replays += 1
            now = [m.training for m in modules]
            for m, mode in zip(modules, modes):
                m.training = mode
            try:
                fresh = self.eager(*args, **kwargs)
            finally:
                for m, mode in zip(modules, now):
                    m.training = mode
            for o, f in zip(tensors_of(out), tensors_of(fresh)):
                o.copy_(f)
        return FakeGraph(replay), out


class FakeStats:
    graphs = 0
    captures = 0


class FakeBackend:
    def __init__(self):
        self.stats = FakeStats()
        self.pool = None


class Dynamo:
    """Stands for Dynamo's path: the model run eagerly, calls counted; in a whole call's warm-up it
    notes a write into a buffer, as the compiled graphs do."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        buffers = list(self.fn.buffers()) if isinstance(self.fn, nn.Module) else []
        versions = [b._version for b in buffers]
        out = self.fn(*args, **kwargs)
        if wc.ACTIVE.mode is not None and [b._version for b in buffers] != versions:
            wc.ACTIVE.updates_state = True
        return out


def whole(model, fake_device):
    fake_device(model)
    return WholeCall(model, FakeBackend()), Dynamo(model)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def compiled_conv_net_on_cuda():
    """A small conv net in eval mode on the GPU and its ``streamdag.compile``, called three times under
    inference mode (compiled, captured, replayed once), with a fresh Dynamo."""
    import streamdag as sd

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).eval().cuda()
    c = sd.compile(m)
    with torch.inference_mode():
        for _ in range(3):
            c(torch.randn(2, 3, 32, 32, device="cuda"))
    return m, c
