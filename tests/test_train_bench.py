"""bench/train.py's gradient check compares what the variants compute: its loss reaches every
parameter, and a gradient that one variant leaves as None and another as zeros is no error."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def train():
    """bench/train.py, loaded with bench/ on the path (it imports its neighbours zoo.py and
    zoo_models.py), which is then put back as it was, with the modules that loading added."""
    path, modules = sys.path[:], set(sys.modules)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("train_bench", ROOT / "bench" / "train.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path[:] = path
        for name in set(sys.modules) - modules:
            del sys.modules[name]


def test_the_loss_of_a_layer_normed_output_still_reaches_the_layers_before_the_norm(train):
    torch.manual_seed(0)
    before, norm = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)
    train.loss_of(norm(before(torch.randn(4, 8)))).backward()
    assert before.weight.grad.norm() > 1e-3  # the mean of squares leaves it near zero (7e-5 here)


def test_a_gradient_left_as_none_by_one_variant_and_zeros_by_another_is_no_error(train):
    ref = {"w": torch.ones(3)}
    assert train.max_rel_err({"w": torch.ones(3), "pooler": torch.zeros(2)}, ref) == 0.0


def test_a_gradient_that_differs_counts_by_its_relative_error_and_one_missing_counts_fully(train):
    ref = {"w": torch.ones(4), "b": torch.full((4,), 2.0)}
    assert train.max_rel_err({"w": torch.ones(4), "b": torch.full((4,), 2.2)}, ref) == pytest.approx(0.1)
    assert train.max_rel_err({"w": torch.ones(4)}, ref) == pytest.approx(1.0)
    # nonzero where the reference has none: measured against a thousandth of the largest norm
    assert train.max_rel_err({"w": torch.ones(4), "b": torch.full((4,), 2.0), "c": torch.ones(2)},
                             ref) > 100


def test_rounding_noise_on_a_gradient_that_is_zero_in_exact_arithmetic_is_no_error(train):
    ref = {"w": torch.ones(4), "bias": torch.full((4,), 1e-9)}
    assert train.max_rel_err({"w": torch.ones(4), "bias": torch.full((4,), -1e-9)}, ref) < 1e-5
