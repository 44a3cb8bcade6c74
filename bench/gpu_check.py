"""Issue 7's GPU check, as one prepared script: decoder speed at batch 1 against the target alone.

Part A, the bundled target (SmolLM2-135M-Instruct) in bfloat16: tokens/s of the target alone and of
n-gram drafting (plus any ``--draft PATH``, e.g. an EAGLE head) on the first turns of dev prompts,
through ``eval.evaluate``, with the growing dynamic cache and with a static cache plus
``torch.compile`` (``--compile-mode``, CUDA graphs by default). Every output is compared with the
target alone of the same setting.

Part B, a random-init target shaped like Llama-3-8B (``--big``; 16 GB of bf16 weights) and a
controlled-acceptance drafter: it knows the target's own greedy continuation (from a plain run) and
proposes it, each token right with probability α (a wrong token ends the run of right ones), at no
draft cost. Measured speedup is set against the ideal τ / (1 + k·c), where τ = (1 − α^(k+1)) / (1 − α)
is the expected tokens per step (``decode.cost_model.expected_tokens``) and c the measured cost of a
verify pass over a plain step (``eval.stats.SpeedupBound``), minus one, over k (so 1 + k·c is what k + 1
tokens cost to verify, in plain steps). Runs are timed by the decoder (``benchlib.timed.decode_each``).

    python bench/gpu_check.py --out $OUT/gpu_check.json                 # on the GPU machine
    python bench/gpu_check.py --tiny --limit 2 --max-new-tokens 16      # CPU smoke test of the script

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import replace

import torch
from benchlib.records import write_json
from benchlib.timed import decode_each

from draftsmith.decode.cost_model import expected_tokens
from draftsmith.decode.drafter import Drafter, Proposal
from draftsmith.decode.sampling import Sampling
from draftsmith.decode.target import Target, load_target
from draftsmith.drafts import build_drafter
from draftsmith.drafts.base import NGRAM
from draftsmith.eval.harness import Method, evaluate, use_static_caches
from draftsmith.eval.prompts import load_prompts, render
from draftsmith.eval.report import hardware_description
from draftsmith.eval.stats import RunStats, SpeedupBound

LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
)  # fmt: skip
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024,
)  # fmt: skip


class ControlledDrafter(Drafter):
    """Proposes the target's known greedy continuation; each token stays right with probability alpha."""

    name = "controlled"

    def __init__(self, reference: list[int], alpha: float, vocab_size: int, seed: int = 0):
        self.reference, self.alpha, self.vocab_size = reference, alpha, vocab_size
        self.rng = random.Random(seed)
        self.prompt_len = 0

    def begin(self, prompt: torch.Tensor, features) -> None:
        self.prompt_len = prompt.numel()

    def propose(self, tokens: torch.Tensor, k: int, sampling: Sampling, generator) -> Proposal:
        done = tokens.numel() - self.prompt_len  # generated so far; the next true token is reference[done]
        truth = self.reference[done : done + k]
        out, right = [], True
        for tok in truth:
            right = right and self.rng.random() < self.alpha
            out.append(tok if right else (tok + 1) % self.vocab_size)
        return Proposal(torch.tensor(out, dtype=torch.long, device=tokens.device))

    def commit(self, num_accepted: int, features) -> None:
        pass


def compile_widths(target: Target, prompt: torch.Tensor, k_max: int) -> None:
    """Run every decode-step width 1..k_max + 1 once, so no compilation happens while timing."""
    for width in range(1, k_max + 2):
        target.reset()
        target.forward(prompt.to(target.device))
        target.forward(torch.zeros(width, dtype=torch.long, device=target.device))


def part_a(args, device: str) -> list[dict]:
    target = load_target("smollm2-135m-instruct", device=device, dtype=args.dtype)
    # first turns only; eval.evaluate warms every method up on the first before timing
    prompts = [
        replace(q, turns=q.turns[:1]) for q in load_prompts(args.prompts, args.limit, order="round-robin")
    ]
    drafters = {spec: build_drafter(spec, target) for spec in [NGRAM, *args.draft]}
    methods = [Method(spec, drafter, args.k) for spec, drafter in drafters.items()]
    rows = []
    for setting in ("dynamic", "static+compile"):
        if setting != "dynamic":
            use_static_caches(
                target, list(drafters.values()), prompts, args.max_new_tokens, args.k, args.compile_mode
            )
            first = render(target.tokenizer, [{"role": "user", "content": prompts[0].turns[0]}])
            compile_widths(target, first, args.k)
        result = evaluate(
            target, methods, prompts, k=args.k, max_new_tokens=args.max_new_tokens, progress=False
        )
        base = result.baseline.total.timing.tokens_per_s
        for method in [result.baseline, *result.drafts]:
            timing, acceptance = method.total.timing, method.total.acceptance
            rows.append({"part": "A", "setting": setting, "method": method.name,
                         "tokens_per_s": timing.tokens_per_s, "speedup": timing.tokens_per_s / base,
                         "tau": acceptance.tau, "exact": len(prompts) - len(method.mismatched_prompts),
                         "prompts": len(prompts)})  # fmt: skip
    return rows


def part_b(args, device: str) -> list[dict]:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    shape = TINY if args.tiny else LLAMA3_8B
    config = LlamaConfig(**shape, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    tokenizer = AutoTokenizer.from_pretrained(_smollm2_dir())  # only for the Target wrapper; ids are random
    target = Target(
        model.eval(), tokenizer, "random-llama3-8b-shape" if not args.tiny else "random-tiny-llama"
    )
    target.eos_ids = set()
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, config.vocab_size, (args.big_prompt_len,), generator=g)
        for _ in range(args.limit + 1)
    ]
    if args.big_compile:
        target.use_static_cache(args.big_prompt_len + args.max_new_tokens + max(args.big_ks) + 2)
        target.compile(args.compile_mode)
        compile_widths(target, prompts[0], max(args.big_ks))
    max_new = args.max_new_tokens
    references = decode_each(target, prompts, None, 0, max_new).outputs
    base = decode_each(target, prompts[1:], None, 0, max_new).stats
    rows = []
    for k in args.big_ks:
        for alpha in args.alphas:
            runs = [  # prompt 0 warms up (and compiles) this k
                decode_each(
                    target, [p], ControlledDrafter(references[i], alpha, config.vocab_size, i), k, max_new
                )
                for i, p in enumerate(prompts)
            ][1:]
            stats = sum((r.stats for r in runs), RunStats())
            bound = SpeedupBound.measure(stats, base)  # verify_cost: a pass over k + 1 tokens / a plain step
            tau_ideal = expected_tokens([alpha] * k, k)
            c = (bound.verify_cost - 1.0) / k
            exact = sum(r.outputs[0] == references[i + 1] for i, r in enumerate(runs))
            rows.append({"part": "B", "k": k, "alpha": alpha, "tau": stats.acceptance.tau,
                         "tau_ideal": tau_ideal, "c": c,
                         "speedup": stats.timing.tokens_per_s / base.timing.tokens_per_s,
                         "ideal_speedup": tau_ideal / (1 + k * c), "exact": exact, "prompts": len(runs)})  # fmt: skip
    return rows


def _smollm2_dir() -> str:
    from draftsmith.loading import SMOLLM2_ALIAS, resolve_model_path

    return resolve_model_path(SMOLLM2_ALIAS)[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default="builtin:dev_prompts")
    p.add_argument("--limit", type=int, default=6, help="timed prompts (part B: one more warms up)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=5)
    p.add_argument(
        "--draft", action="append", default=[], help="another draft for part A (e.g. an EAGLE head)"
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--compile-mode", default="reduce-overhead", help="torch.compile mode (reduce-overhead = CUDA graphs)"
    )
    p.add_argument("--parts", default="AB", help="A, B or AB")
    p.add_argument("--big-ks", type=int, nargs="+", default=[2, 4, 6])
    p.add_argument("--alphas", type=float, nargs="+", default=[0.6, 0.8])
    p.add_argument("--big-prompt-len", type=int, default=128)
    p.add_argument("--big-compile", action="store_true", help="part B with static cache + compile as well")
    p.add_argument("--tiny", action="store_true", help="part B on a tiny random Llama (a CPU smoke test)")
    p.add_argument("--out", default="bench/results/gpu_check.json")
    args = p.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    rows = []
    if "A" in args.parts:
        rows += part_a(args, device)
        for r in rows:
            print(f"A {r['setting']:<15} {r['method']:<28} {r['tokens_per_s']:8.1f} tok/s {r['speedup']:5.2f}x "
                  f"τ {r['tau']:.2f} exact {r['exact']}/{r['prompts']}", flush=True)  # fmt: skip
    if "B" in args.parts:
        for r in part_b(args, device):
            rows.append(r)
            print(f"B k={r['k']} α={r['alpha']:.2f}  τ {r['tau']:.2f} (ideal {r['tau_ideal']:.2f})  c {r['c']:.3f}  "
                  f"speedup {r['speedup']:.2f}x (ideal {r['ideal_speedup']:.2f}x)  exact {r['exact']}/{r['prompts']}",
                  flush=True)  # fmt: skip
    result = {
        "hardware": hardware_description(torch.device(device), getattr(torch, args.dtype)),
        "date": time.strftime("%Y-%m-%d"),
        "settings": vars(args),
        "seconds": time.perf_counter() - start,
        "rows": rows,
    }
    write_json(args.out, result)
    print(f"({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
