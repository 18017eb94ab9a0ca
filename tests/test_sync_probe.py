"""The host-sync probe of a graph's first run counts only the probing thread's syncs.

PyTorch's sync debug mode is faked here (a CPU build has none): a "sync" warns
as PyTorch does while the mode is on.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

from streamdag.runtime.sync_probe import probe_host_syncs

SYNC_WARNING = "called a synchronizing CUDA operation"


@pytest.fixture
def sync_mode(monkeypatch):
    mode = {"value": 0}
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode["value"])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.__setitem__("value", m))
    return mode


@pytest.fixture
def shown(monkeypatch):
    """What reaches ``warnings.showwarning``: what the user would see."""
    seen: list[str] = []
    monkeypatch.setattr(warnings, "showwarning", lambda m, *rest: seen.append(str(m)))
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        yield seen


def fake_sync(mode) -> None:
    if mode["value"] == 1:
        warnings.warn(SYNC_WARNING, UserWarning, stacklevel=1)


def test_an_op_that_syncs_is_found_each_time_even_from_the_same_line(sync_mode, shown):
    found: list[str] = []
    for name in ("first", "second"):
        probe_host_syncs(lambda: fake_sync(sync_mode), name, found)()
    assert found == ["first", "second"]
    assert shown == []  # the mode was off: nobody asked to see the syncs
    assert sync_mode["value"] == 0  # and is off again


def test_another_threads_syncs_do_not_mark_the_probed_op(sync_mode, shown):
    """The race that kept a graph from ever being captured: a sync made elsewhere
    while the probed op ran counted as the op's."""
    probing, done = threading.Event(), threading.Event()
    other_syncs = []

    def other_thread() -> None:
        probing.wait(10)
        while not done.is_set():
            fake_sync(sync_mode)
            other_syncs.append(1)

    def op() -> str:
        probing.set()
        while len(other_syncs) < 20:
            pass
        warnings.warn("a warning of the op's own", RuntimeWarning, stacklevel=1)
        done.set()
        syncer.join(10)  # its syncs all fall inside the probe
        return "result"

    found: list[str] = []
    syncer = threading.Thread(target=other_thread)
    syncer.start()
    try:
        assert probe_host_syncs(op, "quiet", found)() == "result"
    finally:
        done.set()
    assert found == []
    assert shown == ["a warning of the op's own"]  # other warnings pass through
    assert sync_mode["value"] == 0


def test_syncs_stay_shown_when_the_user_turned_the_mode_on(sync_mode, shown):
    sync_mode["value"] = 1
    found: list[str] = []
    other = threading.Thread(target=fake_sync, args=(sync_mode,))

    def op() -> None:
        other.start()
        other.join()
        fake_sync(sync_mode)

    probe_host_syncs(op, "syncs", found)()
    assert found == ["syncs"]
    assert shown == [SYNC_WARNING] * 2
    assert sync_mode["value"] == 1


def test_the_probe_puts_the_mode_and_filters_back_after_a_failure(sync_mode):
    before_filters = list(warnings.filters)

    def fails() -> None:
        fake_sync(sync_mode)
        raise ValueError("boom")

    found: list[str] = []
    with pytest.raises(ValueError, match="boom"):
        probe_host_syncs(fails, "fails", found)()
    assert found == ["fails"]
    assert sync_mode["value"] == 0 and warnings.filters == before_filters


def test_a_sync_begun_during_a_probe_and_reported_after_it_is_not_shown(sync_mode, shown):
    """PyTorch checks the mode when a call starts and warns when it returns: a sync
    that another thread began while the probe had the mode on may warn after it."""
    found: list[str] = []
    probe_host_syncs(lambda: None, "quiet", found)()
    warnings.warn(SYNC_WARNING, UserWarning, stacklevel=1)  # the mode is off again: dropped
    warnings.warn("something else", UserWarning, stacklevel=1)
    sync_mode["value"] = 1  # the user turns it on: shown
    warnings.warn(SYNC_WARNING, UserWarning, stacklevel=1)
    assert found == [] and shown == ["something else", SYNC_WARNING]
