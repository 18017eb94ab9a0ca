"""The compiled hot path (``_speedups.c``), built with the package into ``streamdag.native._speedups``.

What runs for every submitted op: dependency tracking, the byte ranges of
tensors, the stream clocks (``_speedups.c``), and the runtime's submit and
finish around them (``_submit.c``, included by it). The Python code in
``graph/hazards.py``, ``graph/buffers.py``, ``schedule/waits.py`` and
``runtime/core.py`` stays the reference (tests check the two against each
other) and runs the rare paths. On a GPU, :func:`load_torch` adds a torch
extension (``_torch.cpp``) that makes the launch's CUDA calls in C++.

The extension module is compiled when streamdag is built or installed
(``setup.py``: a platform wheel carries it; ``pip install -e .`` builds it in
place in a source checkout); nothing is compiled on import. Where it is not
there (the install had no C compiler or no Python headers), streamdag runs
the Python code and warns once (:class:`~streamdag.errors.StreamdagWarning`);
``streamdag doctor`` says which runs. ``STREAMDAG_NATIVE=0`` chooses the
Python code; ``STREAMDAG_NATIVE=1`` makes a missing module an error instead of
a warning. In a source checkout a module older than its C sources counts as
missing: it would run C that no longer matches the Python code beside it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from .._diagnostics import get_logger, warn

__all__ = ["NativeBuildError", "choices", "load", "load_torch", "status", "torch_status", "twin"]

_HERE = Path(__file__).parent
_log = get_logger(__name__)
_MODULE = f"{__name__}._speedups"
#: what ``_speedups.c`` is compiled from (it includes the others); a source checkout has them
_SOURCES = ("_speedups.c", "_submit.c", "_lock.c", "_torch_hooks.h")

_TORCH_SOURCE = _HERE / "_torch.cpp"
_HOOKS = _HERE / "_torch_hooks.h"
_HOST_COPY = _HERE / "_host_copy.h"  # the torch extension's host copies (C++)

#: how to get the compiled module, for the messages that say it is missing
_HOW_TO_BUILD = (
    "reinstall streamdag where a C compiler and Python's headers (python3-dev) are present "
    "(in a source checkout: `pip install -e .`, or `python setup.py build_ext --inplace`)"
)

_HOW_TO_BUILD_TORCH = ("a C++ compiler, ninja (pip install 'streamdag[torch]') and the CUDA headers make "
                       "it build")

_loaded: ModuleType | None = None
_tried = False
_why_not = ""
_torch_loaded: ModuleType | None = None
_torch_tried = False
_torch_why_not = ""


class NativeBuildError(RuntimeError):
    """The compiled hot path (or the torch extension) is missing, and ``STREAMDAG_NATIVE=1`` asked
    for it."""


def status(where: bool = True) -> str:
    """One line for ``streamdag doctor``: whether the compiled hot path runs (``where``: and its
    file; benchmarks' result files leave it out), and if not, why."""
    module = load()
    if module is not None:
        return f"compiled ({module.__file__})" if where else "compiled"
    return f"Python only: {_why_not}"


_choices: dict[str, bool] = {}  # each twin asked for: whether the compiled one runs


def twin(name: str, python: Any) -> Any:
    """The compiled module's ``name`` where the module is loaded and has it, else ``python`` (the
    Python code, or None for a piece that only the compiled path has).

    ``STREAMDAG_PYTHON_TWINS`` (a comma list of names; for tests and benchmarks, not a setting)
    keeps those pieces in Python while the rest run compiled: what each piece buys is measured so
    (``bench/native_pieces.py``). ``use_torch`` there keeps the torch extension unbuilt.
    """
    module = load()
    kept = _python_twins(module)
    compiled = getattr(module, name, None) if module is not None and name not in kept else None
    _choices[name] = compiled is not None
    return python if compiled is None else compiled


def _python_twins(module: ModuleType | None) -> frozenset[str]:
    """The pieces that ``STREAMDAG_PYTHON_TWINS`` keeps in Python; a name the compiled module does
    not have is an error (a misspelt name would otherwise time the compiled piece as the Python one)."""
    kept = frozenset(n.strip() for n in os.environ.get("STREAMDAG_PYTHON_TWINS", "").split(",") if n.strip())
    unknown = sorted(kept - set(vars(module))) if module is not None else []
    if unknown:
        pieces = sorted(n for n in vars(module) if not n.startswith("_"))
        raise ValueError(f"STREAMDAG_PYTHON_TWINS names {', '.join(unknown)}, which the compiled module does "
                         f"not have: name some of {', '.join(pieces)}")
    records = sorted(kept & _SUBMIT_RECORDS)
    if records and "setup_submit" not in kept:
        raise ValueError(f"STREAMDAG_PYTHON_TWINS keeps {', '.join(records)} in Python, which the compiled "
                         "submit reads in C: name setup_submit too")
    return kept


#: the records the compiled submit reads and writes in C: in Python only with the submit itself
_SUBMIT_RECORDS = frozenset({"Counters", "FutureFields", "OpFields", "Parts"})


def choices() -> dict[str, bool]:
    """Each piece with a compiled twin that the runtime and backends asked for: whether the
    compiled one runs."""
    return dict(_choices)


def load() -> ModuleType | None:
    """The compiled module; None (with one warning) where it is not installed."""
    global _loaded, _tried, _why_not
    if _tried:
        return _loaded
    _tried = True
    if os.environ.get("STREAMDAG_NATIVE", "") == "0":
        _why_not = "STREAMDAG_NATIVE=0"
        return None
    try:
        _loaded = _import_compiled()
    except ImportError as exc:
        _why_not = str(exc)
        _failed(f"{_why_not}. To have it, {_HOW_TO_BUILD}; or unset STREAMDAG_NATIVE",
                f"streamdag runs its Python code: {_why_not}. For about half the host time per submit, "
                f"{_HOW_TO_BUILD}; or set STREAMDAG_NATIVE=0 to run the Python code without this warning.",
                exc)
    return _loaded


def _import_compiled() -> ModuleType:
    """``streamdag.native._speedups``, unless it is missing or older than its sources beside it."""
    spec = importlib.util.find_spec(_MODULE)
    if spec is None or not spec.origin:
        raise ImportError(f"the compiled hot path ({_MODULE}) is not installed: the install did not "
                          "compile it")
    newer = _stale_source(Path(spec.origin))
    if newer is not None:
        raise ImportError(f"the compiled hot path ({spec.origin}) is older than its source {newer}")
    return importlib.import_module(_MODULE)


def _stale_source(built: Path) -> Path | None:
    """A C source beside ``built`` that changed after it was compiled, else None.

    Only a source checkout has ``_speedups.c`` there (a wheel leaves the C out, and its files' times
    are the install's): editing the C without rebuilding would otherwise run the old C against the
    new Python code.
    """
    if not built.with_name(_SOURCES[0]).exists():
        return None
    compiled_at = built.stat().st_mtime
    for name in _SOURCES:
        source = built.with_name(name)
        if source.exists() and source.stat().st_mtime > compiled_at:
            return source
    return None


def _failed(error: str, warning: str, exc: Exception) -> None:
    """A part is missing: ``error`` under ``STREAMDAG_NATIVE=1``, else one ``warning``; each says the fix."""
    if os.environ.get("STREAMDAG_NATIVE", "") == "1":
        raise NativeBuildError(f"STREAMDAG_NATIVE=1, but {error}") from exc
    warn(warning)


def torch_status(where: bool = True) -> str:
    """One line for ``streamdag doctor``: whether a GPU runtime's CUDA calls are made in C++
    (``where``: and the extension's file, as :func:`status`)."""
    module = load_torch()
    if module is not None:
        return f"C++ ({module.__file__})" if where else "C++"
    return f"through PyTorch's Python bindings: {_torch_why_not}"


#: the torch extension's compiler flags. OpenMP: its at::parallel_for runs on PyTorch's CPU threads
#: (the OpenMP runtime PyTorch loaded, the same by name) only where the file is built with it
_TORCH_FLAGS = ["-O2", "-fopenmp"]


def load_torch() -> ModuleType | None:
    """The torch extension (``_torch.cpp``): a GPU runtime's CUDA calls and its reads of tensors,
    in C++ against PyTorch's headers; handed to the compiled hot path, which otherwise makes the
    same calls through PyTorch's Python bindings.

    Built the first time a GPU runtime is made (``torch.utils.cpp_extension``, with CUDA: ~20 s),
    then cached per torch version, Python version and source. None (with one warning) where it
    cannot be built: no compiled hot path, no CUDA, no compiler or CUDA headers.
    ``STREAMDAG_NATIVE=0`` skips it; ``STREAMDAG_NATIVE=1`` makes a failed build an error.
    """
    global _torch_loaded, _torch_tried, _torch_why_not
    if _torch_tried:
        return _torch_loaded
    _torch_tried = True
    module = load()
    if module is None:
        _torch_why_not = "no compiled hot path"
        return None
    if "use_torch" in _python_twins(module):  # its CUDA calls through PyTorch's bindings, to time them
        _torch_why_not = "STREAMDAG_PYTHON_TWINS names use_torch"
        return None
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        _torch_why_not = f"no PyTorch ({exc})"
        return None
    if not torch.cuda.is_available():
        _torch_why_not = "no CUDA here"
        return None
    try:
        python = f"py{sys.version_info.major}{sys.version_info.minor}"
        # one folder per source: two versions of streamdag timed side by side build one each
        source = hashlib.sha256(_TORCH_SOURCE.read_bytes() + _HOOKS.read_bytes() + _HOST_COPY.read_bytes()
                                + repr(_TORCH_FLAGS).encode()).hexdigest()[:12]
        tag = f"torch-{torch.__version__}-{python}-{source}".replace("+", "_")
        build = _cache_dir() / tag
        build.mkdir(parents=True, exist_ok=True)
        if not any(build.glob("*.so")):
            _log.info("building the torch extension (the CUDA calls in C++) against torch %s, once, "
                      "cached in %s (~20 s)", torch.__version__, build)
        # the build's notes (compiler versions) go to the log, not to the user's warnings; its
        # compiler output (verbose=False: kept by PyTorch, never printed) comes with a failure
        with _exclusive_build(build), warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always")
            ext = cpp_extension.load(
                name="_streamdag_torch", sources=[str(_TORCH_SOURCE)], extra_cflags=_TORCH_FLAGS,
                extra_ldflags=["-fopenmp"], extra_include_paths=[str(_HERE)], with_cuda=True,
                build_directory=str(build),
                verbose=False)
        for note in notes:
            _log.debug("the torch extension's build: %s", note.message)
        from ..errors import SubmittedInCapture

        ext.set_submitted_in_capture(SubmittedInCapture)  # what its launch raises inside a capture
        module.use_torch(ext)
        _torch_loaded = ext
    except Exception as exc:
        # the build's whole output (PyTorch keeps the compiler's output in the error) to the log
        _log.debug("the torch extension's build failed:\n%s", exc)
        last = str(exc).strip().splitlines()[-1:]  # a failed build's message ends with the reason
        _torch_why_not = f"{type(exc).__name__}: {last[0] if last else ''}"
        _failed(f"the torch extension failed to build: {_torch_why_not}. {_HOW_TO_BUILD_TORCH}",
                f"streamdag makes its CUDA calls through PyTorch's Python bindings: its torch extension "
                f"did not build ({_torch_why_not}). That costs a few µs per op; {_HOW_TO_BUILD_TORCH}.",
                exc)
    return _torch_loaded


@contextmanager
def _exclusive_build(build: Path) -> Iterator[None]:
    """Hold the build folder against other processes, dropping a lock a dead build left.

    PyTorch's extension build waits, forever, while its ``lock`` file exists,
    and a build killed midway (a timeout, Ctrl-C) leaves it behind: every later
    import then hangs. Our lock is an ``flock``, which the kernel lets go of
    when its process dies; while we hold it no other streamdag process builds
    here, so a ``lock`` file found then is a dead build's.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: PyTorch's own lock only
        yield
        return
    with open(build / "streamdag.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process's build or load: wait for it
        stale = build / "lock"
        if stale.exists():
            _log.warning("removing %s, left by a build of the torch extension that did not finish", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _cache_dir() -> Path:
    """Where the torch extension is built on first use: per user, as it is per torch version."""
    explicit = os.environ.get("STREAMDAG_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "streamdag"
