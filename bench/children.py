"""Running a benchmark's child process with a time limit that holds.

A child that compiles with Inductor starts compile workers which inherit its standard output and
error and outlive it by up to a minute (they look for their parent's death once a minute). Reading
the child's output through pipes, as ``subprocess.run(capture_output=True)`` does, then waits for
those workers too, past any time limit. So the child writes its output to a file, runs in a
session of its own, and at its time limit goes with everything it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
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
        try:
            returncode: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:  # (also on KeyboardInterrupt: nothing the child started stays behind)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.seek(0)
        return Finished(returncode, log.read()[-tail:])
