"""What streamdag tells its user: warnings name the user's line, decisions go to the log, and the
library prints nothing of its own."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import streamdag as sd
from streamdag import _diagnostics

SRC = Path(__file__).resolve().parents[1] / "src"


def test_streamdag_warning_is_a_runtime_warning():
    assert issubclass(sd.StreamdagWarning, RuntimeWarning)


def test_a_warning_given_deep_inside_streamdag_names_the_users_line_past_context_managers():
    # a function whose code lives in streamdag's folder, entered through a context manager, warns
    inside = SRC / "streamdag" / "_a_module_of_streamdag.py"
    code = compile(
        "import contextlib\n"
        "from streamdag._diagnostics import warn\n"
        "@contextlib.contextmanager\n"
        "def block():\n"
        "    yield\n"
        "    warn('said at the end of the block')\n"
        "def deeper():\n"
        "    warn('said two calls down')\n"
        "def api():\n"
        "    deeper()\n",
        str(inside), "exec")
    namespace: dict = {"__name__": "streamdag._a_module_of_streamdag"}
    exec(code, namespace)
    with pytest.warns(sd.StreamdagWarning, match="two calls down") as record:
        namespace["api"]()
    assert record[0].filename == __file__
    with pytest.warns(sd.StreamdagWarning, match="end of the block") as record:
        entered = namespace["block"]()
        with entered:
            pass
    assert (record[0].filename, record[0].lineno) == (__file__, sys._getframe().f_lineno - 2)


def test_a_warning_from_streamdag_compile_names_the_line_that_called_the_model():
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(4, 4)  # parameters that need gradients: calls run eagerly, with a warning
    fast = sd.compile(model, engine="aten")
    with pytest.warns(sd.StreamdagWarning, match="gradients are enabled") as record:
        fast(torch.randn(2, 4))
    assert len(record) == 1 and record[0].filename == __file__


def test_warnings_are_also_logged_among_the_decisions(caplog):
    with caplog.at_level(logging.INFO, logger="streamdag"), pytest.warns(sd.StreamdagWarning):
        _diagnostics.warn("a decision worth a warning")
    assert any(r.name.startswith("streamdag") and "a decision worth a warning" in r.getMessage()
               for r in caplog.records)


def test_a_recorded_graphs_stream_choice_is_logged_at_debug(caplog):
    x = np.ones(64)
    outs = [np.empty(64) for _ in range(4)]
    with caplog.at_level(logging.DEBUG, logger="streamdag"), sd.Runtime("cpu", streams=2) as rt, rt.record():
        for o in outs:
            rt.submit(np.multiply, x, 2.0, out=sd.write(o), reads=[x])
    messages = [r.getMessage() for r in caplog.records if r.name == "streamdag.runtime.recorded"]
    assert any("recorded graph of 4 ops" in m and "of 2 streams" in m for m in messages), messages


def test_the_library_prints_nothing_of_its_own_and_warns_nothing_in_plain_use():
    script = (
        "import numpy as np, streamdag as sd\n"
        "x = np.ones(1000); y = np.empty(1000)\n"
        "with sd.Runtime('cpu', streams=2) as rt:\n"
        "    rt.submit(np.multiply, sd.read(x), 2.0, out=sd.write(y)).result()\n"
        "    with rt.record() as g:\n"
        "        rt.submit(np.add, sd.read(x), sd.read(y), out=sd.write(y))\n"
        "    with rt.profile() as prof:\n"
        "        g.run().result()\n"
        "    prof.timeline.summary()\n"
    )
    done = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True, text=True,
                          env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")


def test_no_library_module_calls_print_or_warnings_warn_itself():
    """Every warning goes through ``_diagnostics.warn`` (the category and the user's line); the
    CLI alone prints. (The dropped runtime's ``ResourceWarning`` follows Python's convention for
    unclosed resources.)"""
    offenders = []
    for path in (SRC / "streamdag").rglob("*.py"):
        if path.name in ("cli.py", "_diagnostics.py"):
            continue
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            code = line.split("#")[0]
            call = " ".join(lines[number - 1:number + 3])  # the call with its arguments
            if "print(" in code or ("warnings.warn(" in code and "ResourceWarning" not in call):
                offenders.append(f"{path.relative_to(SRC)}:{number}: {line.strip()}")
    assert offenders == []


def test_warnings_filter_by_category_turns_them_into_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error", sd.StreamdagWarning)
        with pytest.raises(sd.StreamdagWarning):
            _diagnostics.warn("refused under -W error::streamdag.StreamdagWarning")


def test_the_command_line_shows_the_log_with_verbose(tmp_path):
    pytest.importorskip("threadpoolctl")  # the CPU suite's BLAS threads (the bench extra)
    env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-m", "streamdag", "bench", "--quick", "--cpu", "--out", str(tmp_path)]
    loud = subprocess.run([*command[:3], "-vv", *command[3:]], capture_output=True, text=True, env=env,
                          timeout=300)
    assert loud.returncode == 0, loud.stderr
    assert "streamdag.runtime.recorded: DEBUG: recorded graph of" in loud.stderr, loud.stderr
    quiet = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert quiet.returncode == 0 and "DEBUG" not in quiet.stderr + quiet.stdout
