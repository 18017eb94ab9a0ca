"""Running a benchmark's child process with a time limit that holds.

A child that compiles with Inductor starts compile workers which inherit its standard output and
error and outlive it by up to a minute (they look for their parent's death once a minute). Reading
the child's output through pipes, as ``subprocess.run(capture_output=True)`` does, then waits for
those workers too, past any time limit. So the child writes its output to a file, runs in a
session of its own, and at its time limit goes with everything it started. A child that serves
requests once set up (:class:`ServedChild`) talks over a pair of pipes of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Finished:
    """How a child ended: its exit status (None: killed at its time limit) and its output's end."""

    returncode: int | None
    output: str

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_child(cmd: list[str], timeout: float | None, env: dict[str, str] | None = None,
              tail: int = 4000) -> Finished:
    """Run ``cmd`` to its end or for ``timeout`` seconds, whichever comes first; its standard output
    and error together, the last ``tail`` characters, come back in :attr:`Finished.output`."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        returncode = _wait_then_end(proc, timeout)
        log.seek(0)
        return Finished(returncode, log.read()[-tail:])


def _wait_then_end(proc: subprocess.Popen, timeout: float | None) -> int | None:
    """``proc``'s exit status after up to ``timeout`` seconds (None: it ran past them); then it and
    everything it started end, also where the wait is interrupted (KeyboardInterrupt)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class ServedChild:
    """A child that, once set up, answers requests, one JSON line each way over a pair of pipes of its
    own (its standard output and error go to a log, where Inductor's warnings land): a benchmark
    sets several variants up, one process each, then times them in turns.

    The child gets ``--serve-fds R,W`` (its end of each pipe) after ``cmd`` and answers with
    :func:`serve`. A wait past its time limit, or a child gone, gives None; :meth:`finish` ends it
    and everything it started, and returns how it ended."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        to_child, self._to_child = os.pipe()
        self._from_child, from_child = os.pipe()
        self._log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - open while the child lives
        self.finished: Finished | None = None
        try:
            self.proc = subprocess.Popen([*cmd, "--serve-fds", f"{to_child},{from_child}"], stdout=self._log,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                         pass_fds=(to_child, from_child))
        except BaseException:
            for fd in (to_child, self._to_child, self._from_child, from_child):
                os.close(fd)
            self._log.close()
            raise
        os.close(to_child)
        os.close(from_child)
        self._pending = b""

    def receive(self, timeout: float) -> dict | None:
        """The child's next line, as a dict; None past ``timeout`` seconds or once it has exited
        (looked at every second: a process it started may hold its end of the pipe open)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or self.finished is not None:
                return None
            if not select.select([self._from_child], [], [], min(left, 1.0))[0]:
                if self.proc.poll() is not None:
                    return None
                continue
            data = os.read(self._from_child, 1 << 16)
            if not data:
                return None
            self._pending += data
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def request(self, message: dict, timeout: float) -> dict | None:
        """Send ``message``; the child's answer (None: see :meth:`receive`)."""
        try:
            os.write(self._to_child, (json.dumps(message) + "\n").encode())
        except OSError:
            return None
        return self.receive(timeout)

    def kill(self) -> None:
        """End the child and everything it started at once (:meth:`finish` still reaps it)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def finish(self, timeout: float, tail: int = 4000) -> Finished:
        """Tell the child it is done, wait up to ``timeout`` seconds for it, then end what is left; how
        it ended (the same at a second call)."""
        if self.finished is not None:
            return self.finished
        with contextlib.suppress(OSError):
            os.write(self._to_child, b'{"done": true}\n')
        returncode = None
        try:
            returncode = _wait_then_end(self.proc, timeout)
        finally:
            for fd in (self._to_child, self._from_child):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._log.seek(0)
            output = self._log.read()[-tail:]
            self._log.close()
            self.finished = Finished(returncode, output)
        return self.finished


def serve_fds(fds: str) -> tuple[int, int]:
    """The child's ends of the pipes named by ``--serve-fds``, kept from the processes it starts (an
    Inductor compile worker holding one would keep the parent from seeing the child go)."""
    inbox, outbox = (int(fd) for fd in fds.split(","))
    for fd in (inbox, outbox):
        os.set_inheritable(fd, False)
    return inbox, outbox


def serve(fds: str, ready: dict, answer: Callable[[dict], dict]) -> None:
    """The child's side of :class:`ServedChild`: send ``ready``, then ``answer`` each request until the
    parent says done (or goes)."""
    inbox, outbox = serve_fds(fds)
    with os.fdopen(inbox, "r") as requests, os.fdopen(outbox, "w") as answers:
        answers.write(json.dumps(ready) + "\n")
        answers.flush()
        for line in requests:
            message = json.loads(line)
            if message.get("done"):
                return
            answers.write(json.dumps(answer(message)) + "\n")
            answers.flush()
