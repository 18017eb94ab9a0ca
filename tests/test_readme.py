"""The README's examples run as written (the first on the CPU, the GPU examples on a GPU), and so do
the CPU examples of the guides in docs/: the docs a user reads stay true."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_first_example_runs_as_written(tmp_path, monkeypatch, capsys):
    block = python_blocks()[0]
    assert 'device="cpu"' in block, "the first example is the one that runs without a GPU"
    monkeypatch.chdir(tmp_path)  # it writes trace.json and timeline.png
    exec(compile(block, str(README), "exec"), {"__name__": "readme_example"})
    assert (tmp_path / "trace.json").stat().st_size > 0
    assert (tmp_path / "timeline.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "makespan" in out.lower()


@pytest.mark.cuda
def test_the_copy_example_overlaps_and_returns_the_results():
    import torch

    (block,) = [b for b in python_blocks() if "rt.to_host(" in b and "rt.copy(" in b]
    ns: dict = {"__name__": "readme_example"}
    exec(compile(block, str(README), "exec"), ns)
    for hi, ho in zip(ns["host_in"], ns["host_out"]):
        want = torch.tanh(hi.cuda() @ hi.cuda().T).cpu()
        torch.testing.assert_close(ho, want, rtol=1e-4, atol=1e-4)
    assert ns["t"].is_pinned() and torch.equal(ns["t"], ns["host_out"][0])


@pytest.mark.cuda
def test_the_host_lane_example_summarizes_the_copied_result():
    import textwrap

    import torch

    (block,) = [textwrap.dedent(b) for b in python_blocks() if 'run_on="host"' in b]
    ns: dict = {"__name__": "readme_example"}
    exec(compile(block, str(README), "exec"), ns)
    mean, std = ns["stats"].result()
    want = ns["y"].cpu()
    assert mean == pytest.approx(want.mean().item(), rel=1e-4, abs=1e-4)
    assert std == pytest.approx(want.std().item(), rel=1e-4)
    torch.testing.assert_close(ns["z"].result(), torch.tanh(ns["y"]))


@pytest.mark.cuda
def test_the_stream_map_example_returns_fn_of_each_input():
    import torch

    (block,) = [b for b in python_blocks() if "rt.stream_map(" in b]
    ns: dict = {"__name__": "readme_example"}
    exec(compile(block, str(README), "exec"), ns)
    w = ns["w"]
    for x, out in zip(ns["host_in"], ns["outs"]):
        assert out.is_pinned()
        torch.testing.assert_close(out, torch.tanh(x.cuda() @ w).cpu(), rtol=1e-3, atol=1e-3)


@pytest.mark.ray
def test_the_ray_example_runs_on_a_local_cluster(ray_cluster, capsys):
    (block,) = [b for b in python_blocks() if "streamdag.ray" in b]
    exec(compile(block, str(README), "exec"), {"__name__": "readme_example"})
    assert float(capsys.readouterr().out) > 0


def test_each_gpu_example_of_the_readme_is_found_by_its_test():
    """The GPU tests above pick their example by what it calls; each must find exactly one (checked
    here on the CPU too, where those tests skip)."""
    blocks = python_blocks()
    for marks in (("rt.to_host(", "rt.copy("), ('run_on="host"',), ("rt.stream_map(",)):
        assert len([b for b in blocks if all(m in b for m in marks)]) == 1, marks


DOCS = README.parent / "docs"


def cpu_examples_of_the_guides() -> list:
    examples = []
    for guide in sorted(DOCS.glob("guide-*.md")):
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", guide.read_text(), flags=re.S)):
            if "cuda" not in block:  # the GPU examples need a GPU (and the README's are tested above)
                marks = [pytest.mark.ray] if "streamdag.ray" in block else []
                examples.append(pytest.param(guide, block, id=f"{guide.stem}-{i}", marks=marks))
    return examples


@pytest.mark.parametrize(("guide", "block"), cpu_examples_of_the_guides())
def test_the_cpu_examples_of_the_guides_run_as_written(guide, block, tmp_path, monkeypatch, request):
    if "streamdag.ray" in block:  # on the tests' shared local cluster (skips without ray)
        request.getfixturevalue("ray_cluster")
    monkeypatch.chdir(tmp_path)  # an example may write a trace
    exec(compile(block, str(guide), "exec"), {"__name__": "guide_example"})
