"""How streamdag is installed: its compiled hot path comes with the package, and the command says
what is missing."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import streamdag
from streamdag import native
from streamdag.cli import main


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_import_compiles_nothing_the_compiled_module_comes_with_the_install(tmp_path):
    if native.load() is None:
        pytest.skip(f"no compiled hot path installed here: {native.status()}")
    done = _python("import streamdag\nfrom streamdag import native\nprint(native.status())",
                   CC="/no/such/compiler", STREAMDAG_CACHE_DIR=str(tmp_path), STREAMDAG_NATIVE="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("compiled (") and "streamdag/native/_speedups" in done.stdout
    assert list(tmp_path.iterdir()) == []


def _built_and_sources(folder: Path) -> Path:
    built = folder / "_speedups.so"
    for name in ("_speedups.c", "_submit.c", "_lock.c", "_torch_hooks.h"):
        (folder / name).write_text("")
        os.utime(folder / name, (1000, 1000))
    built.write_bytes(b"")
    os.utime(built, (2000, 2000))
    return built


def test_a_compiled_module_is_current_where_its_sources_are_older(tmp_path):
    assert native._stale_source(_built_and_sources(tmp_path)) is None


def test_an_installed_wheel_is_current_whatever_the_times_of_the_headers_it_carries(tmp_path):
    built = _built_and_sources(tmp_path)
    for source in tmp_path.glob("*.c"):
        source.unlink()  # a wheel carries no C, only the headers the torch extension is built with
    os.utime(tmp_path / "_torch_hooks.h", (3000, 3000))  # installed after the module
    assert native._stale_source(built) is None


@pytest.mark.parametrize("name", ["_speedups.c", "_submit.c", "_lock.c", "_torch_hooks.h"])
def test_a_compiled_module_older_than_any_of_its_sources_is_stale(tmp_path, name):
    built = _built_and_sources(tmp_path)
    os.utime(tmp_path / name, (3000, 3000))
    assert native._stale_source(built) == tmp_path / name


def test_a_stale_compiled_module_is_not_run_and_streamdag_native_1_says_to_rebuild(tmp_path):
    """A checkout whose C changed after the build runs the Python code, not C that no longer
    matches the Python beside it."""
    if native.load() is None:
        pytest.skip(f"no compiled hot path installed here: {native.status()}")
    package = Path(streamdag.__file__).parent
    if not (package / "native" / "_submit.c").exists():
        pytest.skip("an installed wheel: no C sources beside the compiled module")
    shutil.copytree(package, tmp_path / "streamdag", ignore=shutil.ignore_patterns("__pycache__"))
    edited = tmp_path / "streamdag" / "native" / "_submit.c"
    built = Path(native.load().__file__)
    os.utime(edited, (built.stat().st_mtime + 10,) * 2)
    code = "from streamdag import native\nprint(native.status())\n"
    done = _python(code, STREAMDAG_NATIVE="", PYTHONPATH=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Python only: ") and f"is older than its source {edited}" in done.stdout
    done = _python(code, STREAMDAG_NATIVE="1", PYTHONPATH=str(tmp_path))
    assert done.returncode != 0 and "is older than its source" in done.stderr
    assert "build_ext --inplace" in done.stderr


def test_streamdag_version_prints_the_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"streamdag {streamdag.__version__}"


def test_doctor_fails_where_cuda_is_asked_for_and_there_is_none(capsys):
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available() and native.load_torch() is not None:
        pytest.skip("a GPU and the torch extension are here: nothing asked for is missing")
    assert main(["doctor", "--cuda"]) == 1
    err = capsys.readouterr().err
    assert "missing what was asked for" in err


def test_doctor_fails_where_the_compiled_hot_path_is_asked_for_and_python_runs():
    done = _python("import sys\nfrom streamdag.cli import main\nsys.exit(main(['doctor', '--native']))",
                   STREAMDAG_NATIVE="0")
    assert done.returncode == 1, done.stderr
    assert "the compiled hot path: unset STREAMDAG_NATIVE=0" in done.stderr
    code = ("import sys; sys.modules['streamdag.native._speedups'] = None\n"
            "from streamdag.cli import main\nsys.exit(main(['doctor', '--native']))")
    done = _python(code, STREAMDAG_NATIVE="")
    assert done.returncode == 1, done.stderr
    assert "pip install -e ." in done.stderr
    done = _python(code.replace("'--native'", ""), STREAMDAG_NATIVE="")
    assert done.returncode == 0, done.stderr  # not asked for: it runs, slower, and says why
    assert "missing: the compiled hot path" in done.stdout


def test_import_streamdag_loads_no_optional_dependency():
    """The core needs numpy alone: the scheduler's graphs use the standard library (graphlib), the
    benchmark suite's threadpoolctl and the plots' matplotlib load only where used."""
    optional = "{'networkx', 'threadpoolctl', 'matplotlib', 'torch', 'tqdm'}"
    script = f"import sys, streamdag\nprint(sorted({optional} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("choice", ["1", "0"])
def test_each_piece_with_a_compiled_twin_is_chosen_in_one_place_and_doctor_lists_it(choice):
    if choice == "1" and native.load() is None:
        pytest.skip("the compiled hot path is not built here")
    code = ("import streamdag, streamdag.runtime.core\nfrom streamdag import native\n"
            "print(sorted(native.choices().items()))")
    done = _python(code, STREAMDAG_NATIVE=choice)
    assert done.returncode == 0, done.stderr
    chosen = dict(eval(done.stdout))
    assert {"setup_submit", "TrackerFields", "OpFields", "FutureFields", "Lock"} <= set(chosen)
    assert set(chosen.values()) == {choice == "1"}, chosen
