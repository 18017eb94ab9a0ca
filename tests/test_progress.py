"""Progress bars show on a terminal or in a notebook only, and only where tqdm is installed."""

from __future__ import annotations

import io
import sys

import pytest

from streamdag._progress import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_without_a_terminal_the_items_pass_through_untouched(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    items = [1, 2, 3]
    assert progress(items, desc="work") is items
    assert sys.stderr.getvalue() == ""


def test_on_a_terminal_a_bar_counts_the_items_on_stderr(monkeypatch):
    pytest.importorskip("tqdm")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert list(progress(range(3), desc="compiling regions", unit="region")) == [0, 1, 2]
    shown = terminal.getvalue()
    assert "compiling regions" in shown and "/3 " in shown and "region" in shown


def test_a_loop_left_early_closes_its_bar(monkeypatch):
    tqdm = pytest.importorskip("tqdm")
    monkeypatch.setattr(sys, "stderr", _Terminal())
    for i in progress(range(10), desc="work"):
        if i == 2:
            break
    assert not list(tqdm.tqdm._instances)  # closed, not left drawing


def test_on_a_terminal_without_tqdm_the_items_pass_through(monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    items = ["a", "b"]
    assert progress(items, desc="work") is items
    assert sys.stderr.getvalue() == ""


class ZMQInteractiveShell:  # what IPython's get_ipython() returns in a Jupyter kernel
    pass


def test_in_a_notebook_a_bar_counts_the_items_though_stderr_is_no_terminal(monkeypatch):
    pytest.importorskip("tqdm")
    import types

    output = io.StringIO()  # a kernel's stderr: no terminal
    monkeypatch.setattr(sys, "stderr", output)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=ZMQInteractiveShell))
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # tqdm.auto then draws its text bar
    assert list(progress(range(3), desc="compiling regions", unit="region")) == [0, 1, 2]
    assert "compiling regions" in output.getvalue()


def test_in_a_plain_ipython_shell_without_a_terminal_the_items_pass_through(monkeypatch):
    import types

    class TerminalInteractiveShell:
        pass

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=TerminalInteractiveShell))
    items = [1, 2]
    assert progress(items, desc="work") is items
