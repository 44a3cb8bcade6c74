"""llama.cpp's own speculative decoding with draftsmith's GGUF exports, beside `draftsmith eval` of the same drafts.

On the same dev prompts (first turn, the target's chat template, the same prompt token ids in both
engines), greedy, k draft tokens per step:

  llama.cpp (llama-server, one per setting, all up at once, requests interleaved prompt by prompt):
    target alone; n-gram (ngram-simple, N = 3, M = k); the distilled small draft (draft-simple);
    the EAGLE-3 head (draft-eagle3); DFlash drafts (draft-dflash) -- each with the bundled Q4_1 target
    GGUF, and with the same weights dequantized to an F32 GGUF (isolates what quantized verification
    does to acceptance);
  draftsmith (`eval.evaluate`, float32, CPU kernels packed as `draftsmith eval` does): the target
    alone, the EAGLE-3 head, the small draft, the DFlash drafts, n-gram.

A DFlash draft drafts block size - 1 tokens a step in both engines, whatever --k says: llama.cpp decodes
a block of n_max + 1 tokens, and a shorter block than the one trained is attended otherwise.

llama.cpp's acceptance is read from its own per-step log lines ("accepted a/p draft tokens"); steps
without a draft are the tokens left over. tok/s counts prompt processing and generation in both
engines. Prints a table, writes JSON.

    python bench/llamacpp_engine.py --head runs/quickstart/eagle3 --small runs/distill_qs \\
        --prompts builtin:dev_prompts --limit 12 --out bench/results/llamacpp_engine.json

Several heads side by side: ``--head shipped=runs/qs/eagle3 hour=runs/hour/eagle3`` (NAME=DIR; a bare DIR
is named by its folder); DFlash drafts the same way: ``--dflash runs/dflash`` or ``--dflash a=DIR b=DIR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from benchlib.llamacpp_runs import beside_alone, interleaved_runs
from benchlib.records import write_json

from draftsmith import llamacpp
from draftsmith.decode.cpu_kernels import pack_for_decoding
from draftsmith.decode.target import load_target
from draftsmith.draft_checkpoint import locate_checkpoint
from draftsmith.drafts import build_drafter
from draftsmith.drafts.base import DFLASH, EAGLE3, NGRAM
from draftsmith.eval.harness import Method, evaluate
from draftsmith.eval.prompts import load_prompts, render
from draftsmith.eval.report import hardware_description
from draftsmith.export import export_checkpoint
from draftsmith.export.gguf import QTYPES, write_gguf
from draftsmith.loading import resolve_model_path, smollm2_gguf_path

TARGET = "smollm2-135m-instruct"


def named_runs(values: list[str] | None, kind: str) -> dict[str, str]:
    """``--head`` / ``--dflash`` as {setting name: run}: ``KIND`` for one, ``KIND:NAME`` for each of several."""
    runs = dict(h.split("=", 1) if "=" in h else (Path(h).name, h) for h in values or ())
    if len(runs) < len(values or ()):
        raise SystemExit(f"two {kind} drafts share a name ({' '.join(values)}); name them NAME=DIR")
    return (
        {kind: next(iter(runs.values()))} if len(runs) == 1 else {f"{kind}:{n}": r for n, r in runs.items()}
    )


def head_names(args) -> dict[str, str]:
    return named_runs(args.head, EAGLE3)


def feature_drafts(args) -> dict[str, str]:
    """Every draft that reads the target's hidden states (EAGLE-3 heads, DFlash drafts), by setting name."""
    return {**head_names(args), **named_runs(args.dflash, DFLASH)}


def dflash_k(run: str) -> int:
    """The draft tokens of a DFlash draft's whole block (block size - 1), in both engines."""
    return int(locate_checkpoint(run).config["block_size"]) - 1


def exports(args) -> dict[str, Path]:
    """GGUF files: the bundled Q4_1 target, its dequantized F32 copy, the heads and the small draft."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    files = {"q4_1": smollm2_gguf_path(), "f32": work / "target-f32.gguf"}
    if not files["f32"].exists():
        write_gguf(resolve_model_path(TARGET)[0], files["f32"], "f32", smollm2_gguf_path())
    for name, run in (*feature_drafts(args).items(), ("small", args.small)):
        if run:
            files[name] = work / f"{name.replace(':', '-')}-{args.gguf_dtype}.gguf"
            if not files[name].exists():
                export_checkpoint(locate_checkpoint(run), "gguf", files[name], args.gguf_dtype)
    return files


def run_llamacpp(args, files, prompt_ids) -> tuple[dict[str, dict], dict[str, list[list[int]]]]:
    runs = feature_drafts(args)
    drafts = [None, NGRAM, *(d for d in ("small", *runs) if d in files)]
    settings = {}
    for target in args.targets:
        for draft in drafts:
            kind = "draft" if draft == "small" else draft.split(":")[0] if draft else None
            k = dflash_k(runs[draft]) if kind == DFLASH else args.k
            settings[f"{target}:{draft or 'alone'}"] = (
                files[target],
                llamacpp.speculative_args(kind, k, files.get(draft)),
            )
    runs = interleaved_runs(
        settings, prompt_ids, args.max_new_tokens, Path(args.work), args.threads, progress=True
    )
    return beside_alone(runs), {r.name: r.outputs for r in runs}


def run_draftsmith(args, prompts) -> tuple[dict[str, dict], list[list[int]]]:
    target = load_target(TARGET, device="cpu", dtype="float32")
    specs = [*feature_drafts(args).items(), ("small", args.small), (NGRAM, NGRAM)]
    drafts = [Method(name, build_drafter(str(locate_checkpoint(s).draft_dir) if name != NGRAM else s, target),
                     dflash_k(s) if name.startswith(DFLASH) else args.k)
              for name, s in specs if s]  # fmt: skip
    pack_for_decoding(target.model, *(m.drafter for m in drafts))
    result = evaluate(target, drafts, prompts, k=args.k, max_new_tokens=args.max_new_tokens, warmup=1)
    base = result.baseline.total.timing.tokens_per_s
    rows = {"draftsmith:alone": {"tokens_per_s": base, "tokens": result.baseline.total.timing.new_tokens}}
    for d in result.drafts:
        a, t = d.total.acceptance, d.total.timing
        rows[f"draftsmith:{d.name}"] = {
            "tokens": t.new_tokens, "seconds": t.seconds, "tokens_per_s": t.tokens_per_s, "tau": a.tau,
            "alpha": a.alpha, "per_position": a.per_position, "speedup": t.tokens_per_s / base,
            "exact_match": d.exact_match,
        }  # fmt: skip
    return rows, [o[0] for o in result.baseline.outputs], hardware_description(target.device, target.dtype)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How far two engines' greedy outputs agree: prompts identical, mean tokens before the first difference."""
    first = [
        next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a, b)
    ]
    return {
        "identical": sum(p == q for p, q in zip(a, b)),
        "prompts": len(a),
        "mean_common_prefix": sum(first) / len(first),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", nargs="+", metavar="[NAME=]DIR",
                   help="EAGLE-3 heads: run or draft directories (trained for smollm2-135m-instruct)")  # fmt: skip
    p.add_argument("--dflash", nargs="+", metavar="[NAME=]DIR",
                   help="DFlash drafts: run or draft directories (trained for smollm2-135m-instruct); they draft "
                   "block size - 1 tokens a step in both engines")  # fmt: skip
    p.add_argument("--small", help="distilled small draft: run or draft directory")
    p.add_argument("--prompts", default="builtin:dev_prompts")
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--order", default="round-robin")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all cores)")
    p.add_argument("--gguf-dtype", default="f16", choices=list(QTYPES))
    p.add_argument("--targets", default="q4_1,f32", help="llama.cpp target GGUFs: q4_1 (bundled), f32")
    p.add_argument("--work", default="runs/llamacpp", help="folder for the exported GGUFs and server logs")
    p.add_argument("--out", default="bench/results/llamacpp_engine.json")
    args = p.parse_args()
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    llamacpp.tool("llama-server")  # a clear error naming the install command when it is not built

    prompts = [
        dataclasses.replace(q, turns=q.turns[:1])
        for q in load_prompts(args.prompts, args.limit, None, args.order)
    ]
    files = exports(args)
    ds_rows, ds_outputs, hardware = run_draftsmith(args, prompts)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(TARGET)[0])
    prompt_ids = [render(tokenizer, [{"role": "user", "content": q.turns[0]}]).tolist() for q in prompts]
    lc_rows, lc_outputs = run_llamacpp(args, files, prompt_ids)
    rows = {**ds_rows, **lc_rows}

    def fmt(x, spec):
        return "" if x is None else format(x, spec)

    print(f"\n{'method':22s} {'tok/s':>7s} {'τ':>5s} {'α':>5s} {'speedup':>8s}  output = its target alone's")
    for name, r in rows.items():
        print(f"{name:22s} {r['tokens_per_s']:7.1f} {fmt(r.get('tau'), '5.2f'):>5s} {fmt(r.get('alpha'), '5.2f'):>5s} "
              f"{fmt(r.get('speedup'), '7.2f'):>7s}x  {r.get('exact_match', '')}")  # fmt: skip
    agree = {t: agreement(lc_outputs[f"{t}:alone"], ds_outputs) for t in args.targets}
    for t, a in agree.items():
        print(f"llama.cpp {t} target alone vs draftsmith float32 target alone: {a['identical']}/{a['prompts']} "
              f"outputs identical, {a['mean_common_prefix']:.1f} tokens in common on average")  # fmt: skip
    write_json(args.out, {
        "target": TARGET, "settings": vars(args) | {"num_prompts": len(prompts), "greedy": True},
        "hardware": hardware, "date": time.strftime("%Y-%m-%d"), "llamacpp": f"llama-cpp-python {llamacpp.LLAMACPP_PY_VERSION} sdist",
        "methods": rows, "target_alone_agreement": agree,
    })  # fmt: skip


if __name__ == "__main__":
    main()
