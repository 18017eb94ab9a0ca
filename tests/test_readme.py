"""The README's first example runs as written (on the CPU): the docs a user reads first stay true."""

import re
from pathlib import Path

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
