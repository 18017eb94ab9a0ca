"""Where the GPU time of a batched wide graph goes, and which batched form is fastest.

The wide graph of anchors.md with each layer's B matmuls as one op. For the
small and medium cases, each form is captured into a CUDA graph and timed by
CUDA events over replays; the parts (one layer's bmm, its relu, the join) are
timed alone, with the memory traffic and FLOP rate they reach.

Forms:
- ``bmm``: what streamdag's batching pass makes: the shared input expanded, one
  ``bmm`` and one ``relu`` per layer, ``sum(0)`` as the join;
- ``mm first``: the first layer as one ``mm`` over the concatenated weights
  (every branch reads the same input), the rest as ``bmm``;
- ``mm first, relu fused``: the same with the relu in cuBLASLt's epilogue
  (``torch._addmm_activation``).

Run on a GPU machine: PYTHONPATH=src python bench/batched_forms.py
"""

from pathlib import Path

import torch

from streamdag.suite.cuda_timing import graph_of
from streamdag.suite.report import format_table, write_json

CASES = {"small": (32, 4, 64, 1024), "medium": (16, 4, 512, 2048)}


def event_ms(fn, reps=30):
    graph, _ = graph_of(fn)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure_case(B, L, rows, D):
    torch.manual_seed(0)
    x = torch.randn(rows, D, device="cuda")
    W = torch.randn(L, B, D, D, device="cuda") / D**0.5
    W0cat = W[0].permute(1, 0, 2).reshape(D, B * D).contiguous()  # [D, B*D]: branch b in columns b*D..
    zero_bias = torch.zeros(B * D, device="cuda")

    def bmm_form():
        h = x.unsqueeze(0).expand(B, rows, D)
        for layer in range(L):
            h = torch.relu(torch.bmm(h, W[layer]))
        return h.sum(0)

    def rest(h):
        for layer in range(1, L):
            h = torch.relu(torch.bmm(h, W[layer]))
        return h.sum(0)

    def mm_first():
        return rest(torch.relu(x @ W0cat).view(rows, B, D).transpose(0, 1))

    def mm_first_fused():
        return rest(torch._addmm_activation(zero_bias, x, W0cat).view(rows, B, D).transpose(0, 1))

    ref = bmm_form()
    forms = {"bmm": bmm_form, "mm first": mm_first, "mm first, relu fused": mm_first_fused}
    ms = {}
    for label, fn in forms.items():
        err = ((fn() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2, (label, err)
        ms[label] = event_ms(fn)
    h = torch.relu(torch.bmm(x.unsqueeze(0).expand(B, rows, D), W[0]))
    part_bmm = event_ms(lambda: torch.bmm(h, W[1]))
    part_relu = event_ms(lambda: torch.relu(h))
    part_sum = event_ms(lambda: h.sum(0))
    weight_bytes = B * D * D * 4
    act_bytes = B * rows * D * 4
    flops = 2 * B * rows * D * D
    return {
        "B": B, "L": L, "rows": rows, "D": D, "forms_ms": ms,
        "layer_bmm_ms": part_bmm, "layer_relu_ms": part_relu, "join_sum_ms": part_sum,
        "layer_bmm_TBps": (weight_bytes + 2 * act_bytes) / part_bmm / 1e9,
        "layer_bmm_TFLOPps": flops / part_bmm / 1e9,
        "relu_TBps": 2 * act_bytes / part_relu / 1e9,
    }


def main():
    torch.backends.cuda.matmul.allow_tf32 = True
    rows_out, result = [], {}
    for name, shape in CASES.items():
        r = result[name] = measure_case(*shape)
        ms, L = r["forms_ms"], r["L"]
        for label, t in ms.items():
            rows_out.append([name, label, t, ms["bmm"] / t])
        rows_out.append([name, f"parts: {L} x bmm + {L} x relu + sum",
                         L * (r["layer_bmm_ms"] + r["layer_relu_ms"]) + r["join_sum_ms"], float("nan")])
    print(format_table(["case", "form", "GPU ms", "speedup vs bmm"], rows_out))
    for name, r in result.items():
        print(f"{name}: one layer's bmm {r['layer_bmm_ms']:.4f} ms = {r['layer_bmm_TBps']:.2f} TB/s, "
              f"{r['layer_bmm_TFLOPps']:.0f} TFLOP/s; relu {r['layer_relu_ms']:.4f} ms = "
              f"{r['relu_TBps']:.2f} TB/s; join {r['join_sum_ms']:.4f} ms")
    print(write_json(Path(__file__).parent / "results",
                     "batched_forms_" + torch.cuda.get_device_name().replace(" ", "_"), result))


if __name__ == "__main__":
    main()
