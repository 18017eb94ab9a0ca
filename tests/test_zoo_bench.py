"""bench/zoo.py's row plumbing that runs without a GPU: a memory process that fails loses nothing."""

import argparse

import pytest

from bench_scripts import bench_script

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def zoo():
    with bench_script("zoo") as module:
        yield module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the failure path: its process fails without CUDA")
def test_a_variant_whose_memory_process_fails_keeps_its_shared_figure_and_the_row_says_why(zoo):
    row = {"peak_mib": {"eager": 56.0}, "call_mib": {"eager": 24.0}}
    # on a machine without CUDA the process fails (it moves the model to the GPU)
    zoo._memory_of_each_alone(row, "bert", "fp32", 1, ["eager"], 60.0)
    assert row["peak_mib"] == {"eager": 56.0} and row["call_mib"] == {"eager": 24.0}
    assert row["memory"] == "each variant alone in a process (but those in memory_errors)"
    assert set(row["memory_errors"]) == {"eager"} and row["memory_errors"]["eager"].startswith("exit ")


def test_a_worker_over_its_time_limit_leaves_each_row_it_owed_with_the_reason(zoo):
    args = argparse.Namespace(dtypes="fp32,bf16", batches="1", variant_s=10.0, rounds=1, cold_compile=False,
                              memory_alone="all", model_s=0.5)
    rows = zoo._run_worker("bert", args)
    assert sorted((r["dtype"], r["batch"]) for r in rows) == [("bf16", 1), ("fp32", 1)]
    assert all(r["errors"] == {"row": "worker over the 0 s limit"} for r in rows)


def test_memory_alone_takes_every_variant_or_those_named_and_refuses_a_misspelt_one(zoo):
    labels = ["eager", "cuda_graph", "inductor", "inductor_ro", "streamdag"]
    assert zoo.alone_labels("all", labels) == labels
    assert zoo.alone_labels("streamdag, inductor_ro", labels) == ["inductor_ro", "streamdag"]
    with pytest.raises(SystemExit, match=r"unknown variant.*'streamdg'.*choose from eager"):
        zoo.alone_labels("streamdg", labels)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the failure path: its process fails without CUDA")
def test_a_row_whose_memory_some_variants_took_alone_names_them(zoo):
    row = {"peak_mib": {"eager": 56.0, "streamdag": 60.0}, "call_mib": {"eager": 24.0, "streamdag": 0.0}}
    zoo._memory_of_each_alone(row, "bert", "fp32", 1, ["streamdag"], 60.0)
    assert row["memory"].startswith("alone in a process each: streamdag; the others in one")
