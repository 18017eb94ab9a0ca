"""The README's examples run as written (the first on the CPU, the copy example on a GPU): the docs
a user reads first stay true."""

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
