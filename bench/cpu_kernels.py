"""Target forward time by step width, stock PyTorch linears against prepacked oneDNN ones (decode/cpu_kernels.py).

After a prefix of ``--prefix`` random tokens, times a forward of S new tokens (then rolls the cache back)
for each S in ``--widths``: S = 1 is a plain decoding step, S = k + 1 a verify pass. Reports the median
of ``--repeats`` runs, the ratio to S = 1 (what verifying k tokens costs in plain steps) and the packed
speedup, both settings measured in the same process, interleaved.

    python bench/cpu_kernels.py --widths 1 2 3 4 6 8 16 32 49
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from benchlib.records import write_json

from draftsmith.decode.cpu_kernels import pack_linears, packing_unavailable, unpack_linears
from draftsmith.decode.target import load_target
from draftsmith.eval.report import hardware_description


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--prefix", type=int, default=300)
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16, 32, 49])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default="bench/results/cpu_kernels.json")
    args = p.parse_args()

    target = load_target(args.target, device="cpu", dtype="float32")
    why = packing_unavailable(target.device, target.dtype)
    if why:
        raise SystemExit(f"cannot pack here: {why}")
    g = torch.Generator().manual_seed(0)
    vocab = target.vocab_size
    prefix = torch.randint(0, vocab, (args.prefix,), generator=g)
    times: dict[str, dict[int, list[float]]] = {"stock": {}, "packed": {}}
    for _ in range(args.repeats):
        for setting in ("stock", "packed"):
            (pack_linears if setting == "packed" else unpack_linears)(target.model)
            target.reset()
            target.forward(prefix)
            for width in args.widths:
                ids = torch.randint(0, vocab, (width,), generator=g)
                start = time.perf_counter()
                target.forward(ids)
                times[setting].setdefault(width, []).append(time.perf_counter() - start)
                target.rollback(args.prefix)
    rows = []
    print(f"{'width':>6}{'stock ms':>10}{'/ S=1':>7}{'packed ms':>11}{'/ S=1':>7}{'packed speedup':>16}")
    med = {s: {w: statistics.median(v) * 1000 for w, v in t.items()} for s, t in times.items()}
    for w in args.widths:
        stock, packed = med["stock"][w], med["packed"][w]
        rows.append({"width": w, "stock_ms": stock, "packed_ms": packed,
                     "stock_vs_one": stock / med["stock"][args.widths[0]],
                     "packed_vs_one": packed / med["packed"][args.widths[0]], "speedup": stock / packed})  # fmt: skip
        r = rows[-1]
        print(
            f"{w:>6}{stock:>10.1f}{r['stock_vs_one']:>7.2f}{packed:>11.1f}{r['packed_vs_one']:>7.2f}{r['speedup']:>15.2f}x"
        )
    result = {"target": target.name, "hardware": hardware_description(target.device, target.dtype),
              "date": time.strftime("%Y-%m-%d"), "settings": vars(args), "rows": rows}  # fmt: skip
    write_json(args.out, result)


if __name__ == "__main__":
    main()
