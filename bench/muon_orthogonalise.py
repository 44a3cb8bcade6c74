"""Muon's orthogonalisation on this CPU: torch's bf16 Newton-Schulz against ``newton_schulz_bf16`` (the same
iteration with float32 products, each rounded to bf16), over the matrices Muon updates in the default drafts.

For each draft kind, the draft is built for the target as ``draftsmith train`` builds it (its objective, the
quickstart's 8,192-token draft vocabulary) and split as the optimizer splits it (``muon_split``); every Muon
matrix is orthogonalised once per repeat by each function (median of ``--repeats``), summed per kind: the
orthogonalisation share of one optimizer step. ``loading.bf16_is_fast`` says which one training uses here.

    python bench/muon_orthogonalise.py --out bench/results/muon_orthogonalise.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.optim._muon as torch_muon
from benchlib.records import provenance, write_json

from draftsmith.decode.target import load_target
from draftsmith.loading import bf16_is_fast
from draftsmith.train.optimizers import muon_split, newton_schulz_bf16
from draftsmith.train.registry import build_objective

DRAFTS = {  # kind -> draft.options: the quickstart's head and the block drafters' defaults
    "eagle3": {"draft_vocab_size": 8192},
    "dflash": {"num_layers": 1, "block_size": 8, "draft_vocab_size": 8192},
}
COEFFICIENTS, STEPS, EPS = (3.4445, -4.7750, 2.0315), 5, 1e-7  # torch.optim.Muon's defaults


def median_ms(fn, grad: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(grad, COEFFICIENTS, STEPS, EPS)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results/muon_orthogonalise.json")
    args = p.parse_args()

    target = load_target(args.target, device="cpu", dtype="float32")
    counts = torch.randint(1, 1000, (target.vocab_size,))  # any counts: only the draft's shapes matter here
    torch.manual_seed(0)
    kinds = {}
    print(f"{'draft':<8}{'matrices':>9}{'torch bf16 ms':>15}{'float32-rounded ms':>20}{'ratio':>8}")
    for kind, options in DRAFTS.items():
        draft = build_objective(kind, target, options, counts).build_draft()
        trainable = [(n, q) for n, q in draft.named_parameters() if q.requires_grad]
        matrices, _ = muon_split(draft, trainable)
        rows = []
        for weight in matrices:
            grad = torch.randn(weight.shape)
            rows.append({"shape": list(weight.shape),
                         "torch_bf16_ms": median_ms(torch_muon._zeropower_via_newtonschulz, grad, args.repeats),
                         "float32_rounded_ms": median_ms(newton_schulz_bf16, grad, args.repeats)})  # fmt: skip
        bf16 = sum(r["torch_bf16_ms"] for r in rows)
        emulated = sum(r["float32_rounded_ms"] for r in rows)
        kinds[kind] = {
            "options": options,
            "matrices": rows,
            "torch_bf16_ms": bf16,
            "float32_rounded_ms": emulated,
        }
        print(f"{kind:<8}{len(rows):>9}{bf16:>15.0f}{emulated:>20.0f}{bf16 / emulated:>8.1f}")
    used = "torch's bf16" if bf16_is_fast("cpu") else "float32-rounded"
    print(f"training here orthogonalises with {used} products (loading.bf16_is_fast)")
    write_json(args.out, {"target": target.name, "settings": vars(args), "kinds": kinds, "used_here": used,
                          "provenance": provenance()})  # fmt: skip


if __name__ == "__main__":
    main()
