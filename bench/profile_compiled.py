"""Where the host time of one streamdag.compile call goes (googlenet, batch 1, captured).

Run on a GPU machine: PYTHONPATH=src python bench/profile_compiled.py
"""

import cProfile
import pstats
import time

import torch
import torchvision

import streamdag as sd

for dtype in (torch.float32, torch.bfloat16):
    model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=False)
    model = model.eval().cuda().to(dtype)
    x = torch.randn(1, 3, 224, 224, device="cuda", dtype=dtype)
    fast = sd.compile(model, engine="aten")
    with torch.inference_mode():
        for _ in range(5):
            fast(x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            fast(x)
        t_host = (time.perf_counter() - t0) / 50 * 1e3
        torch.cuda.synchronize()
        t_all = (time.perf_counter() - t0) / 50 * 1e3
        print(f"{dtype}: host per call {t_host:.3f} ms, with GPU {t_all:.3f} ms, "
              f"choice {fast._entries and next(iter(fast._entries.values())).graph.statistics().choice_ms}")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            fast(x)
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    fast.close()
