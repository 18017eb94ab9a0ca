"""The installed wheel works on its own: run by scripts/test with the venv the wheel went into,
from outside the checkout, so that ``import streamdag`` finds the installed package."""

import os
import sys
from pathlib import Path

import numpy as np

import streamdag as sd
from streamdag import native

checkout = Path(sys.argv[1]).resolve()
package = Path(sd.__file__).resolve().parent
assert checkout not in package.parents, f"imported the checkout ({package}), not the installed wheel"
assert os.environ.get("STREAMDAG_NATIVE") == "1", "run with STREAMDAG_NATIVE=1: the compiled module must load"
assert native.load() is not None, native.status()
assert Path(native.load().__file__).parent == package / "native", native.status()
assert not list((package / "native").glob("*.c")), "the wheel carries C sources it does not need"
a = np.zeros(4)
with sd.Runtime("cpu", streams=2) as rt:
    rt.submit(np.add, a, 1, out=a, writes=[a])
    rt.submit(np.multiply, a, 3, out=a, writes=[a])
assert a.tolist() == [3.0] * 4, a
print(f"wheel smoke test: streamdag {sd.__version__} installed in {package.parent}, hot path "
      f"{native.status()}")
