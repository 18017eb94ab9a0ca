"""The built-in benchmark suite: workloads shared by ``streamdag bench`` and ``bench/`` scripts."""
