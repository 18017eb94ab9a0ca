"""The check before each replay of a captured graph that its tensor arguments kept their layout.

A CUDA graph baked in its arguments' addresses, sizes and strides; a change
to any of them must make the runner capture again, and nothing else may.
Here the check made of PyTorch's own C++ checks (where the torch extension
is not loaded); ``tests/test_cuda_streams.py`` covers the extension's on a GPU.
"""

import pytest
import torch

from streamdag.runtime.capture import _checked_by_pytorch


def _square_and_long():
    return [torch.zeros(4, 4), torch.zeros(16)]


@pytest.mark.parametrize("change", [
    lambda ts: ts[0].t_(),  # the same shape, its strides swapped
    lambda ts: ts[1].resize_(32),  # a new shape (and maybe a new address)
    lambda ts: ts[1].resize_(8),  # smaller: the same address
    lambda ts: ts[0].set_(torch.zeros(4, 4)),  # another storage
    lambda ts: ts[1].as_strided_((8,), (2,)),  # the same address, new sizes and strides
], ids=["t_", "resize_larger", "resize_smaller", "set_", "as_strided_"])
def test_a_changed_address_shape_or_strides_fails_the_check(change):
    tensors = _square_and_long()
    unchanged = _checked_by_pytorch(tensors)
    assert unchanged()
    change(tensors)
    assert not unchanged()


def test_what_a_graph_does_not_bake_in_passes_the_check():
    tensors = _square_and_long()
    unchanged = _checked_by_pytorch(tensors)
    tensors[0].fill_(3)  # values
    tensors[1].requires_grad_()  # fails PyTorch's guard, which checks more than a graph needs
    with torch.inference_mode():
        assert unchanged()
    assert unchanged()
