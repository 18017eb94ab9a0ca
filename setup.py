"""The compiled hot path (``src/streamdag/native/_speedups.c``) as an optional C extension.

Everything else about the package is in ``pyproject.toml``. The extension is optional: where it
does not compile (no C compiler, no Python headers) the install still succeeds with a warning,
and streamdag runs its Python code, warning once on import. ``pip install -e .`` builds it in
place, beside its sources; after editing the C, ``python setup.py build_ext --inplace`` rebuilds
it alone (an import of a module older than its sources fails under ``STREAMDAG_NATIVE=1``, and
falls back to the Python code otherwise). ``CFLAGS`` adds compiler flags, e.g.
``CFLAGS=-fno-omit-frame-pointer`` for a profiler's call graphs.
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = "src/streamdag/native"


class OptionalBuildExt(build_ext):
    """Builds the extension where it can, and warns instead of failing where it cannot."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # e.g. no compiler at all for this platform
            self._skipped(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # the compiler failed: missing headers, an unsupported platform
            self._skipped(exc)

    def _skipped(self, exc: Exception) -> None:
        line = "=" * 78
        print(f"{line}\nWARNING: streamdag's compiled hot path did not build ({type(exc).__name__}: {exc}).\n"
              "streamdag is installed and runs its Python code, about twice the host time per submit.\n"
              "Install a C compiler and Python's headers (python3-dev) and reinstall for the compiled one.\n"
              f"{line}", file=sys.stderr)


speedups = Extension(
    "streamdag.native._speedups",
    sources=[f"{NATIVE}/_speedups.c"],
    # included by _speedups.c: a change to one rebuilds the module
    depends=[f"{NATIVE}/_submit.c", f"{NATIVE}/_lock.c", f"{NATIVE}/_torch_hooks.h"],
    extra_compile_args=[] if sys.platform == "win32" else ["-fvisibility=hidden"],
)

setup(ext_modules=[speedups], cmdclass={"build_ext": OptionalBuildExt})
