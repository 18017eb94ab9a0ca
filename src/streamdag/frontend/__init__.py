"""The PyTorch frontend: ``streamdag.compile`` and the ``torch.compile`` backend. Imports torch."""

from .compiled import Compiled, CompileStatistics, compile

__all__ = ["CompileStatistics", "Compiled", "compile"]
