"""Loading a script of bench/ as a module in a test."""

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


@contextmanager
def bench_script(name: str) -> Iterator[ModuleType]:
    """bench/<name>.py, loaded with bench/ on the path (scripts import their neighbours, such as
    zoo_models.py), which is then put back as it was, with the modules of bench/ that loading
    added. (Library modules it imported stay: dropping Inductor's, say, and importing them again
    registers their caches twice, which fails every later compile in the process.)"""
    path, modules = sys.path[:], set(sys.modules)
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # (a dataclass looks its module up there)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path[:] = path
        for added in set(sys.modules) - modules:
            origin = getattr(sys.modules[added], "__file__", None) or ""
            if added == f"{name}_bench" or Path(origin).resolve().parent == BENCH:
                del sys.modules[added]
