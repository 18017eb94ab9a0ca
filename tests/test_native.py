"""Which hot path runs: the compiled one (``native/_speedups.c``) where the package was built
with it, else the Python code, with one warning (an error where ``STREAMDAG_NATIVE=1`` requires the
compiled one; none with ``STREAMDAG_NATIVE=0``); the pure layers load no compiled code; how the
torch extension is built, or why not. The compiled parts are checked against their Python
references, step by step, in the other ``test_native_*.py`` files."""

import os
import subprocess
import sys

import pytest

from streamdag import native
from streamdag.graph import buffers, hazards
from streamdag.runtime import accel
from streamdag.schedule import waits

torch = pytest.importorskip("torch")


compiled = pytest.mark.skipif(native.load() is None, reason=f"no compiled hot path: {native.status()}")


def test_the_runtime_uses_the_compiled_hot_path_where_it_builds():
    if os.environ.get("CI") and os.environ.get("STREAMDAG_NATIVE") != "0":  # (=0: scripts/test's last run)
        assert native.load() is not None, native.status()  # CI machines have a compiler: it must run there
    if native.load() is None:
        assert (accel.DepsTracker, accel.StreamClocks) == (hazards.PyDepsTracker, waits.PyStreamClocks)
        assert accel.accesses is buffers._py_accesses
        assert accel.CompiledDepsTracker is accel.CompiledStreamClocks is accel.compiled_accesses is None
    else:
        assert accel.DepsTracker is accel.CompiledDepsTracker
        assert issubclass(accel.DepsTracker, native.load().TrackerFields)
        assert accel.StreamClocks is accel.CompiledStreamClocks
        assert issubclass(accel.StreamClocks, native.load().Clocks)
        assert accel.accesses is accel.compiled_accesses is native.load().accesses
    from streamdag import Runtime

    with Runtime("cpu", streams=2) as rt:
        assert type(rt._tracker) is accel.DepsTracker and type(rt._clocks) is accel.StreamClocks
    assert native.status()


@pytest.mark.parametrize("path", ["compiled", "python"], indirect=True)
def test_the_path_fixture_makes_runtimes_run_the_hot_path_it_names(path):
    """The ``path`` fixture (conftest.py) that runs the runtime's tests on both: on "python", a
    runtime submits, tracks, places and counts with the Python code alone, as where the compiled
    module is not built; on "compiled", with the compiled parts."""
    import threading

    import numpy as np

    from streamdag import Runtime
    from streamdag.runtime import arguments, ops

    on_python = path == "python"
    with Runtime("cpu", streams=2) as rt:
        a = np.zeros(4)
        assert rt.submit(np.add, a, 1, out=a, writes=[a]).result() is a
        assert (type(rt.submit).__name__ == "method") == on_python  # else the compiled submitter's
        assert (type(rt._tracker) is hazards.PyDepsTracker) == on_python
        assert (type(rt._clocks) is waits.PyStreamClocks) == on_python
        assert (type(rt._parts) is ops._Parts) == on_python
        assert (type(rt._done_lock) is type(threading.Lock())) == on_python
        assert (arguments.accesses_of is buffers._py_accesses) == on_python


@compiled
def test_the_python_path_refuses_a_compiled_part_it_has_no_python_twin_for(monkeypatch):
    """A compiled part added to the package without a twin in tests/internals.py would stay in the
    runtimes of the Python path, which would then not be the Python code: the swap says so."""
    from internals import python_reference
    from streamdag.runtime import arguments, ops

    monkeypatch.setattr(ops, "new_record", native.load().Record, raising=False)
    refused = pytest.raises(AssertionError, match=r"ops.new_record is the compiled Record.*add it")
    with refused, python_reference():
        pass
    assert arguments.accesses_of is accel.accesses  # and what it had swapped is back


def test_the_pure_layers_load_no_compiled_code():
    """graph/ and schedule/ import no compiled code: the runtime chooses it (runtime/accel.py).
    The package's ``__init__`` imports the runtime, so the subprocess imports them under a bare
    package, as a program that uses the pure layers alone would see them."""
    code = ("import importlib.util, sys, types\n"
            "package = types.ModuleType('streamdag')\n"
            "package.__path__ = list(importlib.util.find_spec('streamdag').submodule_search_locations)\n"
            "sys.modules['streamdag'] = package\n"
            "import streamdag.schedule.plan, streamdag.graph.hazards, streamdag.graph.buffers\n"
            "assert 'streamdag.native._speedups' not in sys.modules\n"
            "loaded = [m for m in sys.modules if m.startswith(('streamdag.native', 'streamdag.runtime'))]\n"
            "assert not loaded, loaded\n"
            "assert streamdag.schedule.plan.build_schedule([[], [0], [0]], 2).num_waits == 1\n")
    done = _python(code, STREAMDAG_NATIVE="1")
    assert done.returncode == 0, done.stderr


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


#: a subprocess's first line that makes it run as if the install had not compiled the hot path
_NOT_BUILT = "import sys; sys.modules['streamdag.native._speedups'] = None\n"


def test_without_the_compiled_module_streamdag_warns_once_at_the_users_import_and_runs_python():
    code = (
        _NOT_BUILT
        + "import numpy as np, streamdag as sd\n"  # line 2: where the warning must point
        "from streamdag import native\n"
        "from streamdag.graph import hazards\n"
        "from streamdag.runtime import accel\n"
        "assert accel.DepsTracker is hazards.PyDepsTracker\n"
        "a = np.zeros(4)\n"
        "with sd.Runtime('cpu', streams=2) as rt:\n"
        "    rt.submit(np.add, a, 1, out=a, writes=[a])\n"
        "    rt.submit(np.multiply, a, 3, out=a, writes=[a])\n"
        "assert a.tolist() == [3.0] * 4\n"
        "print(native.status())\n"
    )
    done = _python(code, STREAMDAG_NATIVE="")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Python only:") and "not installed" in done.stdout
    assert done.stderr.count("StreamdagWarning") == 1 and "STREAMDAG_NATIVE=0" in done.stderr
    assert done.stderr.startswith("<string>:2: StreamdagWarning: "), done.stderr


def test_a_required_compiled_hot_path_that_is_not_installed_is_an_error_that_says_how_to_build_it():
    done = _python(_NOT_BUILT + "import streamdag", STREAMDAG_NATIVE="1")
    assert done.returncode != 0 and "NativeBuildError" in done.stderr and "STREAMDAG_NATIVE=1" in done.stderr
    assert "pip install -e ." in done.stderr


def test_streamdag_native_0_runs_the_python_code_without_a_warning():
    done = _python("import warnings; warnings.simplefilter('error')\n"
                   "import streamdag\nfrom streamdag import native\nprint(native.status())",
                   STREAMDAG_NATIVE="0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Python only: STREAMDAG_NATIVE=0"


@compiled
def test_streamdag_python_twins_keeps_the_named_pieces_in_python_and_the_rest_compiled():
    """What each compiled piece buys is measured with it alone in Python (bench/native_pieces.py)."""
    code = ("import threading, numpy as np, streamdag as sd\n"
            "from streamdag import native\n"
            "from streamdag.graph import hazards\n"
            "from streamdag.runtime import accel, ops\n"
            "a = np.zeros(4)\n"
            "with sd.Runtime('cpu', streams=2) as rt:\n"
            "    assert rt.submit(np.add, a, 1, out=a, writes=[a]).result() is a\n"
            "    assert type(rt.submit).__name__ != 'method'\n"  # the compiled submitter's
            "assert a.tolist() == [1.0] * 4\n"
            "assert accel.DepsTracker is hazards.PyDepsTracker and ops.new_rlock is ops._PyRLock\n"
            "assert ops.new_lock is native.load().Lock\n"
            "print(sorted(name for name, compiled in native.choices().items() if not compiled))\n")
    done = _python(code, STREAMDAG_NATIVE="1", STREAMDAG_PYTHON_TWINS="TrackerFields, RLock")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['RLock', 'TrackerFields']"
    done = _python("from streamdag import native; print(native.torch_status())", STREAMDAG_NATIVE="1",
                   STREAMDAG_PYTHON_TWINS="use_torch")  # the torch extension too: CUDA calls through bindings
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("STREAMDAG_PYTHON_TWINS names use_torch")


@compiled
@pytest.mark.parametrize(("kept", "fix"), [("Lock,Lok", "name some of BudgetCounts"),
                                           ("OpFields", "name setup_submit too")])
def test_streamdag_python_twins_refuses_a_piece_it_cannot_keep_in_python_and_names_the_fix(kept, fix):
    done = _python("import streamdag", STREAMDAG_PYTHON_TWINS=kept)
    assert done.returncode != 0 and "ValueError: STREAMDAG_PYTHON_TWINS" in done.stderr and fix in done.stderr


def test_without_cuda_the_torch_extension_is_not_built_and_doctor_says_why():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/test_cuda_streams.py requires the extension instead")
    assert native.load_torch() is None
    status = native.torch_status()
    assert status.startswith("through PyTorch's Python bindings: ")
    assert ("no CUDA here" in status) or ("no compiled hot path" in status), status


def test_a_lock_left_by_a_killed_extension_build_is_dropped_not_waited_on_forever(tmp_path):
    """PyTorch's extension build waits while its ``lock`` file exists; a build killed midway leaves
    one, and every later import hung on the GPU machine. Under streamdag's own (flock) lock such a
    file is a dead build's, and goes; another process's build is waited for through the flock."""
    fcntl = pytest.importorskip("fcntl")
    (tmp_path / "lock").write_text("")
    with native._exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()
        with open(tmp_path / "streamdag.lock") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: another process would wait
    with open(tmp_path / "streamdag.lock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # let go after the build


@compiled
def test_the_status_names_the_compiled_file_for_doctor_and_leaves_it_out_of_result_files():
    assert native.status().startswith("compiled (") and native.load().__file__ in native.status()
    assert native.status(where=False) == "compiled"
