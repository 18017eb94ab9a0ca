"""docs/benchmarks.md is generated from bench/results/ by scripts/benchmarks_page.py: the numbers the
docs show are the numbers in the result files."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_generator():
    spec = importlib.util.spec_from_file_location("benchmarks_page", ROOT / "scripts" / "benchmarks_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_benchmarks_md_is_what_the_generator_makes_from_bench_results():
    generator = load_generator()
    assert (ROOT / "docs" / "benchmarks.md").read_text() == generator.page(), (
        "docs/benchmarks.md is out of date: run python scripts/benchmarks_page.py")


def test_every_result_file_in_bench_results_has_a_section_on_the_page():
    text = load_generator().page()
    results = [p for p in (ROOT / "bench" / "results").glob("*.json") if not p.name.startswith("trace_")]
    assert results
    for path in results:
        assert f"### `{path.name}`" in text


def test_a_result_file_named_after_no_known_benchmark_is_refused_with_the_fix(tmp_path):
    (tmp_path / "mystery_gpu.json").write_text(json.dumps({"environment": {}, "ms": {"a": 1.0}}))
    with pytest.raises(SystemExit, match="add it to BENCHMARKS"):
        load_generator().page(tmp_path)


def test_a_flat_result_renders_one_row_per_variant(tmp_path):
    env = {"gpu": "Some GPU", "gpus": 1, "python": "3.11", "torch": "2.4", "cuda": "12", "streamdag": "0.1.0"}
    (tmp_path / "host_lanes_Some_GPU.json").write_text(json.dumps({"environment": env,
                                                                   "ms": {"fast": 1.5, "slow": 3.25}}))
    text = load_generator().page(tmp_path)
    assert "| fast | 1.500 |" in text and "| slow | 3.250 |" in text
    assert "Some GPU; Python 3.11, PyTorch 2.4, CUDA 12, streamdag 0.1.0." in text


def test_a_compile_host_result_renders_one_row_per_model_and_variant(tmp_path):
    env = {"gpu": "Some GPU", "gpus": 1, "python": "3.11", "torch": "2.4", "cuda": "12", "streamdag": "0.1.0"}
    rows = [{"model": "googlenet", "variant": "streamdag", "host_us": 21.5, "latency_ms": 0.57,
             "replay_ms": 0.55, "added_us": 20.0, "compile_s": 30.0},
            {"model": "googlenet", "variant": "reduce_overhead", "host_us": 90.0, "latency_ms": 0.945,
             "replay_ms": None, "compile_s": 25.0}]
    (tmp_path / "compile_host_Some_GPU.json").write_text(json.dumps({"environment": env, "rows": rows}))
    text = load_generator().page(tmp_path)
    assert "| googlenet | streamdag | 21.500 | 0.570 | 0.550 | 20.000 | 30.000 |" in text
    assert "| googlenet | reduce_overhead | 90.000 | 0.945 |" in text


def tp_result(gpus):
    """A result of bench/tp.py on ``gpus`` GPUs, laid out as streamdag.suite.tp.run writes it."""
    ns = [n for n in (1, 2, 4, 8) if n <= gpus]
    names = [f"cuda:{g}" for g in range(gpus)]
    cases = []
    for rows, one in ((8, 0.3), (16384, 12.8)):
        by_n = {}
        for n in ns:
            ms = one if rows == 8 else one / (0.9 * n)
            entry = {"streamdag_input_whole_ms": ms, "speedup_input_whole": one / ms,
                     "plan_input_whole": "single" if n == 1 or rows == 8 else f"split{n}",
                     "goal_speedup": 0.98 if rows == 8 else {1: 0.98, 2: 1.85, 4: 3.5, 8: 6.5}[n],
                     "explain": "...", "graphs_captured": [True]}
            if n > 1:
                entry.update(streamdag_input_split_ms=ms * 0.95, speedup_input_split=one / ms / 0.95,
                             plan_input_split=entry["plan_input_whole"], hand_made_nccl_ms=ms * 1.1,
                             hand_made_rows_ms=ms * 1.25)
            by_n[str(n)] = entry
        cases.append({"rows": rows, "layers": 4, "one_gpu_ms": one, "by_n": by_n})
    links = {"devices": names,
             "latency_us": [[None if s == d else 20.0 for d in range(gpus)] for s in range(gpus)],
             "GBps": [[None if s == d else (50.0 if 3 in (s, d) else 350.0) for d in range(gpus)]
                      for s in range(gpus)]}
    return {"benchmark": "tp", "dtype": "bfloat16", "D": 8192, "iters": 20, "gpus": gpus, "ns": ns,
            "device_names": ["NVIDIA H200"] * gpus,
            "nccl": {"version": None,
                     "problems": {str(n): "this torch build has no NCCL" for n in ns if n > 1}},
            "links": links, "cases": cases, "peer_copy": None}


@pytest.mark.parametrize("gpus", [4, 8])
def test_tp_results_of_several_gpus_render_a_row_per_case_and_gpu_count_and_the_link_matrix(tmp_path, gpus):
    env = {"gpu": "NVIDIA H200", "gpus": gpus, "python": "3.12", "torch": "2.11", "cuda": "13.0",
           "streamdag": "0.1.0"}
    name = f"tp_H200x{gpus}.json"
    (tmp_path / name).write_text(json.dumps({"environment": env, **tp_result(gpus)}))
    text = load_generator().page(tmp_path)
    assert f"### `{name}`" in text and f"NVIDIA H200 (of {gpus} on the host)" in text
    assert f"on the first N of {gpus} GPUs" in text
    assert f"| 16384 × 8192, 4 | {gpus} | 12.800 | {12.8 / (0.9 * gpus):.3f} ({0.9 * gpus:.2f}x) |" in text
    assert f"| split{gpus} |" in text and "| 8 × 8192, 4 | 1 | 0.300 | 0.300 (1.00x) | — |" in text
    row = ("| 8 × 8192, 4 | 2 | 0.300 | 0.300 (1.00x) | 0.285 (1.05x) | 0.98x | 0.375 (0.80x) "
           "| 0.330 (0.91x) | — |")
    assert row in text  # row split, NCCL, no peer-copy version
    assert f"| from {gpus - 1} |" in text and "| from 3 | 50 | 50 | 50 |" in text  # device 3 on a slow link
    assert "NCCL baseline not run: 2 GPUs: this torch build has no NCCL" in text


def test_the_tp_table_of_the_suite_reads_the_same_layout():
    pytest.importorskip("torch")
    from streamdag.suite import tp

    text = tp.table(tp_result(8))
    assert "split8" in text and "met" in text
    assert "MISSED" in text  # one GPU's chain at 0.9x of PyTorch's misses the 0.98x floor
    assert "peer links (56 ordered pairs): 50-350 GB/s" in text


def test_the_tp_benchmark_runs_every_gpu_count_that_fits_and_refuses_the_others_with_the_fix():
    pytest.importorskip("torch")
    from streamdag.suite import tp

    assert [tp.visible_ns(g) for g in (1, 2, 3, 4, 7, 8)] == [[1], [1, 2], [1, 2], [1, 2, 4], [1, 2, 4],
                                                              [1, 2, 4, 8]]
    assert tp.visible_ns(4, [4, 1, 4]) == [1, 4]
    with pytest.raises(ValueError, match=r"\[8\] do not fit the 4 GPU\(s\) visible: ask for at most 4"):
        tp.visible_ns(4, [2, 8])
    with pytest.raises(ValueError, match=r"GPU counts \[3\]: the benchmark runs 1, 2, 4, 8 GPUs"):
        tp.visible_ns(4, [3])
    assert tp.goal(8, 8) == 0.98 and tp.goal(16384, 8) == 6.5 and tp.goal(4096, 4) == 3.5


def test_an_llm_decode_result_renders_one_row_per_config_and_batch(tmp_path):
    env = {"gpu": "Some GPU", "gpus": 1, "python": "3.11", "torch": "2.4", "cuda": "12", "streamdag": "0.1.0"}
    row = {"config": {"name": "1b", "params": 1.24e9, "dtype": "bf16", "batch": 8},
           "ms_per_token": {"hf_eager": 20.0, "inductor_ro_static_cache": 6.5, "streamdag": 6.25},
           "tokens_per_s": {"hf_eager": 400.0, "inductor_ro_static_cache": 1230.0, "streamdag": 1280.0},
           "prefill_ms": {"hf_eager": 30.0, "inductor_ro_static_cache": 31.0, "streamdag": 29.5},
           "bound": {"ms_per_token": 0.5, "tokens_per_s": 16000.0, "bandwidth_tbs": 4.8},
           "tokens_equal": {"streamdag": {"equal": False, "first_difference": 17}}}
    (tmp_path / "llm_decode_Some_GPU.json").write_text(json.dumps({"environment": env, "rows": [row]}))
    text = load_generator().page(tmp_path)
    assert ("| 1b | 1.24B | bf16 | 8 | 20.000 (400.0) | 6.500 (1230.0) | 6.250 (1280.0) | 0.500 (16000.0) "
            "| 30.000 | 31.000 | 29.500 | streamdag: differs from token 17 |") in text
    assert "over 4.8 TB/s" in text


def test_an_llm_decode_result_with_the_regions_variant_shows_its_columns_and_others_show_none():
    generator = load_generator()
    row = {"config": {"name": "wide", "params": 8.03e9, "dtype": "bf16", "batch": 1},
           "ms_per_token": {"streamdag": 5.8, "streamdag_regions": 5.85},
           "tokens_per_s": {"streamdag": 172.5, "streamdag_regions": 171.1},
           "prefill_ms": {"streamdag": 23.8, "streamdag_regions": 40.4},
           "bound": {"ms_per_token": 3.346, "tokens_per_s": 298.9, "bandwidth_tbs": 4.8}}
    text = generator.render_llm_decode({"rows": [row]})
    assert "streamdag, regions on streams" in text and "regions prefill ms" in text
    assert "| 5.800 (172.5) | 5.850 (171.1) | 3.346 (298.9) |" in text
    plain = dict(row, ms_per_token={"streamdag": 5.8}, prefill_ms={"streamdag": 23.8})
    assert "regions" not in generator.render_llm_decode({"rows": [plain]})


def test_a_zoo_row_shows_host_time_over_a_replay_only_where_calls_were_timed_from_an_idle_gpu():
    generator = load_generator()
    base = {"model": "resnet50", "dtype": "fp32", "batch": 1, "streams": 1,
            "ms": {"eager": 3.0, "cuda_graph": 0.9, "inductor": 2.0, "inductor_ro": 1.1, "streamdag": 0.6},
            "peak_mib": {"inductor_ro": 56.0, "streamdag": 56.0},
            "compile_s": {"inductor": 6.0, "streamdag": 7.0},
            # calls issued back to back: the GPU's queue may be in it, so it is not shown
            "host_us": {"cuda_graph": 5.0, "streamdag": 150.0}}
    idle = dict(base, batch=8, idle_host_us={"cuda_graph": 4.5, "streamdag": 17.0})
    text = generator.render_zoo({"models": [base, idle]})
    old_row, new_row = [line for line in text.splitlines() if line.startswith("| resnet50")]
    assert old_row.endswith("| — |") and new_row.endswith("| 12.5 |")


def test_a_zoo_model_that_a_run_skipped_renders_no_row_and_one_it_lost_a_row_without_times():
    generator = load_generator()
    done = {"model": "resnet50", "dtype": "fp32", "batch": 1, "streams": 1,
            "ms": {"eager": 3.0, "cuda_graph": 0.9, "inductor": 2.0, "inductor_ro": 1.1, "streamdag": 0.6}}
    lost = {"model": "gpt2", "dtype": "bf16", "batch": 1, "errors": {"worker": "timed out after 600 s"}}
    text = generator.render_zoo({"models": [done, {"model": "vgg16", "skipped": "over the 120 s budget"},
                                            lost]})
    assert "| resnet50 |" in text and "vgg16" not in text
    assert "| gpt2 | bf16 | 1 | — |" in text


def test_a_training_variant_timed_in_another_run_than_its_row_shows_no_ratio_to_the_row():
    generator = load_generator()
    row = {"ms": {"inductor_ro": 5.0, "streamdag": 6.0, "streamdag_step": 4.0},
           "measured_apart": {"streamdag_step": {"commit": "old"}}}
    assert generator.same_run_ratio(row, 5.0, "streamdag") == "6.000 (0.83x)"
    assert generator.same_run_ratio(row, 5.0, "streamdag_step") == "4.000 (timed apart)"
    assert generator.same_run_ratio(row, 5.0, "inductor_step") == "—"
