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
