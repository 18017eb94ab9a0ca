"""bench/train.py's gradient check compares what the variants compute: its loss reaches every
parameter, and a gradient that one variant leaves as None and another as zeros is no error."""


import pytest
import torch

from bench_scripts import bench_script


@pytest.fixture(scope="module")
def train():
    with bench_script("train") as module:
        yield module


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


def test_a_variant_as_accurate_as_eager_against_float64_passes_the_check(train):
    ref = {"w": torch.ones(4, dtype=torch.float64), "b": torch.full((4,), 2.0, dtype=torch.float64)}
    eager = {"w": torch.full((4,), 1.01), "b": torch.full((4,), 2.0)}
    assert train.grad_check({"w": torch.full((4,), 0.98), "b": torch.full((4,), 2.01)}, eager, ref) == "ok"


def test_a_gradient_off_by_far_more_than_eager_rounding_fails_the_check_and_is_named(train):
    ref = {"w": torch.ones(4, dtype=torch.float64), "b": torch.full((4,), 2.0, dtype=torch.float64)}
    eager = {"w": torch.full((4,), 1.001), "b": torch.full((4,), 2.0)}
    verdict = train.grad_check({"w": torch.full((4,), 1.001), "b": torch.full((4,), 2.2)}, eager, ref)
    assert verdict.startswith("b: error 1.00e-01")
    assert train.grad_check({"w": torch.full((4,), 1.001)}, eager, ref).startswith("b: error 1.00e+00")


def test_the_float64_reference_is_the_same_step_in_float64(train):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    x = torch.randn(4, 6)
    ref = train.reference_grads(model, (x,), {})
    assert all(g.dtype == torch.float64 for g in ref.values()) and model[0].weight.grad is None
    train.loss_of(model(x)).backward()
    assert train.max_rel_err({n: q.grad for n, q in model.named_parameters()}, ref) < 1e-5


def test_the_tiny_row_on_the_cpu_passes_its_gradient_check_for_every_variant(train):
    part = train.measure_variant("streamdag", "tiny", "fp32", 4, "cpu", rounds=1)
    assert not part["errors"], part["errors"]
    assert part["grad_check"] == {"streamdag": "ok"}
    assert part["grad_max_rel_err"]["streamdag"] < 1e-3 and part["grad_max_rel_err"]["eager"] < 1e-3


def test_a_warm_only_variant_process_compiles_and_measures_nothing(train):
    part = train._in_child("streamdag", "tiny", "fp32", 4, 1, 300, 0, warm_only=True)
    assert part["errors"] == {} and part["ms"] == {} and part["peak_mib"] == {}
    assert part["grad_check"] == {"streamdag": "ok"}  # its first step ran, and was checked


def test_variants_in_processes_of_their_own_are_timed_in_turns_and_a_failed_setup_is_the_rows_note(train):
    """On the CPU, the tiny row's eager variant and one that cannot run here (a whole step needs CUDA
    graphs): the first is set up, timed in turns and checked; the second's error comes back."""
    row = {"model": "tiny", "dtype": "fp32", "batch": 4, "ms": {}, "grad_max_rel_err": {}, "grad_check": {},
           "peak_mib": {}, "errors": {}}
    row = train._row_in_turns(row, ("eager", "inductor_step"), rounds=4, variant_s=300, gpu=0)
    assert set(row["ms"]) == {"eager"} and row["ms"]["eager"] > 0
    assert "needs CUDA graphs" in row["errors"]["inductor_step"]
    assert row["grad_max_rel_err"]["eager"] < 1e-3


def test_a_row_measured_again_with_some_variants_keeps_the_others_stamped_with_their_run(train):
    earlier = {"ms": {"eager": 20.0, "streamdag": 4.6, "streamdag_step": 3.9},
               "peak_mib": {"streamdag_step": 610}, "errors": {},
               "streamdag_step": {"step": ["one graph"]}, "measured": {"commit": "old"}}
    row = {"ms": {"eager": 19.0, "streamdag": 6.6}, "peak_mib": {"streamdag": 716}, "errors": {},
           "measured": {"commit": "new"}}
    train.carry_variants(row, earlier)
    assert row["ms"] == {"eager": 19.0, "streamdag": 6.6, "streamdag_step": 3.9}
    assert row["peak_mib"] == {"streamdag": 716, "streamdag_step": 610}
    assert row["streamdag_step"] == {"step": ["one graph"]}
    assert row["measured_apart"] == {"streamdag_step": {"commit": "old"}}
    again = {"ms": {"eager": 18.0}, "errors": {"streamdag": "RuntimeError: lost"},
             "measured": {"commit": "newer"}}
    train.carry_variants(again, row)  # a variant that failed this run is this run's, not carried
    assert again["ms"] == {"eager": 18.0, "streamdag_step": 3.9}
    assert again["measured_apart"] == {"streamdag_step": {"commit": "old"}}  # the run that measured it
    train.carry_variants(again, None)
    assert again["ms"] == {"eager": 18.0, "streamdag_step": 3.9}
