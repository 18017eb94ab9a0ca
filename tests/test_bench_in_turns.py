"""bench/in_turns.py: variants in processes of their own, set up one after another, timed in turns; a
variant that fails or stops answering is ended at once and named, the others go on."""

import sys
import time

import pytest

from bench_scripts import BENCH, bench_script

# a stand-in variant: argv is its behaviour, the file where it notes each request, then --serve-fds R,W
_VARIANT = """
import sys, time
sys.path.insert(0, {bench!r})
from children import serve
how, log = sys.argv[1], sys.argv[2]
answered = 0
def answer(asked):
    global answered
    answered += 1
    if how.startswith("stop after ") and answered > int(how.split()[-1]):
        sys.exit(3)
    with open(log, "a") as f:
        f.write(f"{{sys.argv[3]}} {{asked['steps']}} {{asked['warm']}}\\n")
    return {{"ms": [float(sys.argv[4])] * asked["steps"]}}
if how == "no setup":
    time.sleep(60)
serve(sys.argv[-1], {{"ready": how != "setup fails"}}, answer)
"""


@pytest.fixture(scope="module")
def in_turns():
    with bench_script("in_turns") as module:
        yield module


def _command(how, log, label, ms):
    return [sys.executable, "-c", _VARIANT.format(bench=str(BENCH)), how, str(log), label, str(ms)]


def test_every_variant_is_timed_in_turns_whose_order_changes_until_each_has_its_rounds(in_turns, tmp_path):
    log = tmp_path / "requests"
    commands = {label: _command("ok", log, label, ms) for label, ms in (("a", 1.0), ("b", 2.0), ("c", 3.0))}
    turns = in_turns.time_in_turns(commands, rounds=7, limit_s=60, env=None, name="row")
    assert turns.ms == {"a": 1.0, "b": 2.0, "c": 3.0} and turns.errors == {}
    requests = [line.split() for line in log.read_text().splitlines()]
    for label in "abc":  # 3 + 3 + 1 steps, each turn after one untimed step
        assert [(steps, warm) for who, steps, warm in requests if who == label] == [("3", "1"), ("3", "1"),
                                                                                  ("1", "1")]
    firsts = [requests[i][0] for i in range(0, 9, 3)]
    assert len(set(firsts)) == 3  # a different variant begins each turn
    assert requests[0:3] != requests[3:6]


def test_a_variant_that_fails_its_setup_or_stops_answering_is_named_and_the_others_are_timed(
        in_turns, tmp_path):
    log = tmp_path / "requests"
    commands = {"broken": _command("setup fails", log, "broken", 1.0),
                "ok": _command("ok", log, "ok", 2.0),
                "stops": _command("stop after 1", log, "stops", 3.0)}
    t0 = time.perf_counter()
    turns = in_turns.time_in_turns(commands, rounds=6, limit_s=60, env=None, name="row")
    assert time.perf_counter() - t0 < 40  # (a child gone is seen at once, not at the time limit)
    assert turns.ms == {"ok": 2.0}
    assert turns.errors["broken"] == "its setup failed"
    assert turns.errors["stops"].startswith("its process stopped answering at turn 1")
    assert "(exit " in turns.errors["stops"]  # (killed, or gone by itself: its status either way)


def test_a_variant_not_set_up_in_time_is_ended(in_turns, tmp_path):
    commands = {"slow": _command("no setup", tmp_path / "requests", "slow", 1.0)}
    t0 = time.perf_counter()
    turns = in_turns.time_in_turns(commands, rounds=3, limit_s=2, env=None, name="row")
    assert turns.ms == {} and turns.errors["slow"].startswith("not set up within 2 s")
    assert time.perf_counter() - t0 < 30
