"""The runtime's threads query events in relaxed capture mode, and give a user's thread its own back."""

import ctypes
import threading

import pytest

from streamdag.backends import capture_mode


@pytest.fixture
def driver(monkeypatch):
    """A stand-in for the driver's cuThreadExchangeStreamCaptureMode: a mode per thread, calls counted."""
    modes: dict[int, int] = {}
    calls = []

    def exchange(pointer):
        value = ctypes.cast(pointer, ctypes.POINTER(ctypes.c_int)).contents
        me = threading.get_ident()
        previous = modes.get(me, 0)
        modes[me] = value.value
        value.value = previous
        calls.append(modes[me])
        return 0

    monkeypatch.setattr(capture_mode, "_exchange_fn", exchange)
    monkeypatch.setattr(capture_mode, "_thread", threading.local())
    return modes, calls


def test_relaxed_gives_the_thread_its_own_mode_back_even_after_an_error(driver):
    modes, calls = driver
    me = threading.get_ident()
    with pytest.raises(ValueError), capture_mode.relaxed():
        assert modes[me] == capture_mode.RELAXED
        raise ValueError
    assert modes[me] == 0 and calls == [capture_mode.RELAXED, 0]
    with capture_mode.relaxed():  # and again: the first block left nothing behind
        assert modes[me] == capture_mode.RELAXED
    assert modes[me] == 0


def test_nested_blocks_and_a_thread_relaxed_for_good_make_no_further_calls(driver):
    modes, calls = driver
    with capture_mode.relaxed(), capture_mode.relaxed():
        pass
    assert calls == [capture_mode.RELAXED, 0]

    def completion_thread():  # sets its own mode once, as the runtime's completion thread does
        capture_mode.exchange(capture_mode.RELAXED)
        with capture_mode.relaxed():
            assert modes[threading.get_ident()] == capture_mode.RELAXED

    thread = threading.Thread(target=completion_thread)
    thread.start()
    thread.join()
    assert calls == [capture_mode.RELAXED, 0, capture_mode.RELAXED]


def test_a_driver_error_is_raised_with_its_number(monkeypatch):
    monkeypatch.setattr(capture_mode, "_exchange_fn", lambda pointer: 3)
    with pytest.raises(RuntimeError, match="driver error 3"):
        capture_mode.exchange(capture_mode.RELAXED)


def test_without_the_driver_function_it_warns_once_and_changes_nothing(monkeypatch):
    monkeypatch.setattr(capture_mode, "_exchange_fn", None)
    monkeypatch.setattr(capture_mode, "_thread", threading.local())

    def no_driver(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(capture_mode.ctypes, "CDLL", no_driver)
    with pytest.warns(RuntimeWarning, match="capture_error_mode='relaxed'"):
        assert capture_mode.exchange(capture_mode.RELAXED) is None
    with capture_mode.relaxed():  # no second warning, no error
        pass
