"""The compiled hot path (``_speedups.c``), built on first use with the machine's C compiler.

What runs for every submitted op: dependency tracking, the byte ranges of
tensors, the stream clocks (``_speedups.c``), and the runtime's submit and
finish around them (``_submit.c``, included by it). The Python code in
``graph/hazards.py``, ``graph/buffers.py``, ``schedule/waits.py`` and
``runtime/core.py`` stays the reference (tests check the two against each
other) and runs the rare paths. On a GPU, :func:`load_torch` adds a torch
extension (``_torch.cpp``) that makes the launch's CUDA calls in C++.

The extension is built with ``$CC``, else the compiler Python was built
with, against this Python's headers, into a cache folder (``STREAMDAG_CACHE_DIR``, else
``$XDG_CACHE_HOME/streamdag`` or ``~/.cache/streamdag``), once per source
and Python version: about a second. Without a compiler, streamdag runs the
Python code and warns once; ``streamdag doctor`` says which runs.
``STREAMDAG_NATIVE=0`` chooses the Python code; ``STREAMDAG_NATIVE=1``
makes a failed build an error instead of a warning; ``STREAMDAG_CFLAGS`` adds
compiler flags (``-fno-omit-frame-pointer`` for a profiler's call graphs).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

__all__ = ["NativeBuildError", "load", "load_torch", "status", "torch_status"]

_SOURCE = Path(__file__).with_name("_speedups.c")
_SOURCES = sorted([*_SOURCE.parent.glob("*.c"), *_SOURCE.parent.glob("*.h")])
_NAME = "_streamdag_speedups"

_TORCH_SOURCE = _SOURCE.with_name("_torch.cpp")
_HOOKS = _SOURCE.with_name("_torch_hooks.h")
_HOST_COPY = _SOURCE.with_name("_host_copy.h")  # the torch extension's host copies (C++)

_loaded: ModuleType | None = None
_tried = False
_why_not = ""
_torch_loaded: ModuleType | None = None
_torch_tried = False
_torch_why_not = ""


class NativeBuildError(RuntimeError):
    """The compiled hot path could not be built, and ``STREAMDAG_NATIVE=1`` asked for it."""


def status() -> str:
    """One line for ``streamdag doctor``: whether the compiled hot path runs, and if not, why."""
    module = load()
    if module is not None:
        return f"compiled ({module.__file__})"
    return f"Python only: {_why_not}"


def load() -> ModuleType | None:
    """The compiled module, built if needed; None (with one warning) where it cannot be."""
    global _loaded, _tried, _why_not
    if _tried:
        return _loaded
    _tried = True
    choice = os.environ.get("STREAMDAG_NATIVE", "")
    if choice == "0":
        _why_not = "STREAMDAG_NATIVE=0"
        return None
    try:
        _loaded = _import(_build())
    except Exception as exc:
        _why_not = f"{type(exc).__name__}: {exc}"
        _failed("the compiled hot path", _why_not, exc,
                f"streamdag runs its Python code: the compiled hot path did not build ({_why_not}). "
                "Install a C compiler and Python's headers (python3-dev) for about half the host time "
                "per submit, or set STREAMDAG_NATIVE=0 to run the Python code without this warning.")
    return _loaded


def _failed(what: str, why: str, exc: Exception, warning: str) -> None:
    """A build failed: an error under ``STREAMDAG_NATIVE=1``, else one warning that says the fix."""
    if os.environ.get("STREAMDAG_NATIVE", "") == "1":
        raise NativeBuildError(f"STREAMDAG_NATIVE=1, but {what} failed: {why}") from exc
    warnings.warn(warning, RuntimeWarning, stacklevel=4)


def torch_status() -> str:
    """One line for ``streamdag doctor``: whether a GPU runtime's CUDA calls are made in C++."""
    module = load_torch()
    if module is not None:
        return f"C++ ({module.__file__})"
    return f"through PyTorch's Python bindings: {_torch_why_not}"


#: the torch extension's compiler flags. OpenMP: its at::parallel_for runs on PyTorch's CPU threads
#: (the OpenMP runtime PyTorch loaded, the same by name) only where the file is built with it
_TORCH_FLAGS = ["-O2", "-fopenmp"]


def load_torch() -> ModuleType | None:
    """The torch extension (``_torch.cpp``): a GPU runtime's CUDA calls and its reads of tensors,
    in C++ against PyTorch's headers; handed to the compiled hot path, which otherwise makes the
    same calls through PyTorch's Python bindings.

    Built the first time a GPU runtime is made (``torch.utils.cpp_extension``, with CUDA: ~20 s
    on the lent H100), then cached per torch version, Python version and source. None (with one
    warning) where it cannot be built: no compiled hot path, no CUDA, no compiler or CUDA headers.
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
        # one folder per source: two versions of streamdag (an A/B run) must not rebuild each other's
        source = hashlib.sha256(_TORCH_SOURCE.read_bytes() + _HOOKS.read_bytes() + _HOST_COPY.read_bytes()
                                + repr(_TORCH_FLAGS).encode()).hexdigest()[:12]
        tag = f"torch-{torch.__version__}-{python}-{source}".replace("+", "_")
        build = _cache_dir() / tag
        build.mkdir(parents=True, exist_ok=True)
        if not any(build.glob("*.so")):
            print(f"streamdag: building its CUDA calls against torch {torch.__version__} "
                  f"(once, cached in {build}; ~20 s)", file=sys.stderr, flush=True)
        with _exclusive_build(build), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the extension build's notes on compiler versions
            ext = cpp_extension.load(
                name="_streamdag_torch", sources=[str(_TORCH_SOURCE)], extra_cflags=_TORCH_FLAGS,
                extra_ldflags=["-fopenmp"], extra_include_paths=[str(_SOURCE.parent)], with_cuda=True,
                build_directory=str(build),
                verbose=False)
        from ..errors import SubmittedInCapture

        ext.set_submitted_in_capture(SubmittedInCapture)  # what its launch raises inside a capture
        module.use_torch(ext)
        _torch_loaded = ext
    except Exception as exc:
        last = str(exc).strip().splitlines()[-1:]  # a failed build's message ends with the reason
        _torch_why_not = f"{type(exc).__name__}: {last[0] if last else ''}"
        _failed("the torch extension", _torch_why_not, exc,
                f"streamdag makes its CUDA calls through PyTorch's Python bindings: its torch extension "
                f"did not build ({_torch_why_not}). That costs a few µs per op; a C++ compiler, ninja "
                "and the CUDA headers make it build.")
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
            print(f"streamdag: removing {stale}, left by a build that did not finish", file=sys.stderr,
                  flush=True)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _cache_dir() -> Path:
    explicit = os.environ.get("STREAMDAG_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "streamdag"


def _build() -> Path:
    """The shared library for this source and this Python, compiled unless cached."""
    source = b"".join(p.read_bytes() for p in _SOURCES)  # _speedups.c includes the others
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    extra = shlex.split(os.environ.get("STREAMDAG_CFLAGS", ""))  # e.g. -fno-omit-frame-pointer to profile
    key = hashlib.sha256(source + sys.version.encode() + suffix.encode() + " ".join(extra).encode())
    key = key.hexdigest()[:16]
    target = _cache_dir() / f"{_NAME}-{key}{suffix}"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    include = sysconfig.get_paths()["include"]
    fd, tmp = tempfile.mkstemp(suffix=suffix, dir=target.parent)  # then renamed: processes may race
    os.close(fd)
    cmd = [*compiler, "-O2", *extra, "-shared", "-fPIC", "-fvisibility=hidden", f"-I{include}", str(_SOURCE),
           "-o", tmp]
    if sys.platform == "darwin":
        cmd[1:1] = ["-undefined", "dynamic_lookup"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"`{' '.join(cmd[:2])} ...` failed: {' | '.join(tail)}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_NAME, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
