"""Matrix products on this CPU in float32 and bfloat16, at the shapes training and data generation use.

For each shape, the median time of ``--repeats`` products in both dtypes (same process, interleaved)
and the rate in TFLOP/s. The shapes are SmolLM2-135M's: a training micro-batch of 4 x 512 tokens
through an MLP weight, the same through the 49,152-wide LM head, and a decode step at batch 64. The
last rows time the LM head on a strided [B, 1, H] input, the view transformers hands it when it scores
only the last position of a prompt, against the same input made contiguous: on a CPU that strided
product goes through ``bmm`` with the weight copied once per row (pytorch/pytorch#151934), which is
why ``load_causal_lm`` makes the LM head's input contiguous. ``bf16_is_fast`` says what ``auto``
chooses here.

    python bench/cpu_bf16.py --out bench/results/cpu_bf16.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from benchlib.records import write_json

from draftsmith.eval.report import hardware_description
from draftsmith.loading import CPU_BF16_FLAGS, bf16_is_fast, cpu_flags

SHAPES = [  # (name, rows, in, out)
    ("training batch x MLP weight", 2048, 576, 1536),
    ("training batch x LM head", 2048, 576, 49152),
    ("decode step (batch 64) x MLP weight", 64, 576, 1536),
]


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # first call: kernel selection, weight layout
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--strided-rows", type=int, default=64, help="batch of the strided LM-head rows")
    p.add_argument("--out", default="bench/results/cpu_bf16.json")
    args = p.parse_args()

    torch.manual_seed(0)
    rows = []
    print(f"{'shape':<40}{'fp32 ms':>9}{'bf16 ms':>9}{'fp32 TF/s':>11}{'bf16 TF/s':>11}{'bf16 speedup':>14}")
    for name, m, k, n in SHAPES:
        ms = {}
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
            ms[dtype] = median_ms(lambda x=x, w=w: F.linear(x, w), args.repeats)
        flops = 2 * m * k * n
        row = {"shape": name, "m": m, "k": k, "n": n, "fp32_ms": ms[torch.float32], "bf16_ms": ms[torch.bfloat16],
               "fp32_tflops": flops / ms[torch.float32] / 1e9, "bf16_tflops": flops / ms[torch.bfloat16] / 1e9}  # fmt: skip
        row["bf16_speedup"] = row["fp32_ms"] / row["bf16_ms"]
        rows.append(row)
        print(f"{name:<40}{row['fp32_ms']:>9.2f}{row['bf16_ms']:>9.2f}{row['fp32_tflops']:>11.2f}"
              f"{row['bf16_tflops']:>11.2f}{row['bf16_speedup']:>13.1f}x")  # fmt: skip

    b = args.strided_rows
    print(f"\nLM head (576 -> 49,152) on the last position of a [{b}, 86, 576] prompt batch:")
    print(f"{'dtype':<10}{'strided ms':>12}{'contiguous ms':>15}{'ratio':>9}")
    strided = []
    for dtype in (torch.float32, torch.bfloat16):
        hidden, w = torch.randn(b, 86, 576, dtype=dtype), torch.randn(49152, 576, dtype=dtype)
        last = hidden[:, -1:, :]
        slow = median_ms(lambda last=last, w=w: F.linear(last, w), max(1, args.repeats // 3))
        fast = median_ms(lambda last=last, w=w: F.linear(last.contiguous(), w), args.repeats)
        strided.append(
            {"dtype": str(dtype).removeprefix("torch."), "strided_ms": slow, "contiguous_ms": fast}
        )
        print(f"{strided[-1]['dtype']:<10}{slow:>12.1f}{fast:>15.1f}{slow / fast:>8.0f}x")

    flags = sorted(f for f in cpu_flags() if f in CPU_BF16_FLAGS)
    fast = bf16_is_fast("cpu")
    print(
        f"\nbf16 matrix instructions here: {', '.join(flags) or 'none'}; auto chooses {'bfloat16' if fast else 'float32'}"
    )
    result = {"hardware": hardware_description(torch.device("cpu"), torch.float32), "date": time.strftime("%Y-%m-%d"),
              "threads": torch.get_num_threads(), "bf16_flags": flags, "auto_chooses_bf16": fast,
              "products": rows, "strided_lm_head": strided}  # fmt: skip
    write_json(args.out, result)


if __name__ == "__main__":
    main()
