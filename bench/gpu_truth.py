"""Issue 19's GPU truth as one prepared script: the target's own answers at GPU speed, an EAGLE-3 head
trained on them, and the shared decoder timed on the GPU against the target alone and transformers.

Stages, in one process, on the bundled target in bf16, each fitted into ``--minutes`` of wall time:

  data    prompts: the first user turns of the shipped training files plus ``data synthesize``'s
          Magpie-style requests written by the target; answers: ``data regenerate`` with transformers'
          continuous batching (finished rows refilled at once), stopped at ``--data-minutes``.
          Replies cut at ``--max-new-tokens`` are flagged; training learns no end of turn after them.
  train   configs/smollm2_eagle3.yaml online on those answers for the minutes left (steps fitted to the
          measured step time: ``train.speed.fit_and_train``), with an 8,192-row draft vocabulary; the head
          comes back packed (no embedding, bf16) as ``head-*.safetensors`` plus ``meta.tar``.
  decode  through ``eval.evaluate``, greedy, batch 1, on dev prompts: the target alone, n-gram and the
          head (k = 5, ``k auto``, a tree), eagerly and with static cache + CUDA graphs, every output
          compared with the target alone of the same setting; transformers ``generate``,
          ``prompt_lookup_num_tokens`` and ``assistant_model`` (the target's first layers: no
          distilled draft is small enough to carry) interleaved on the same prompts; then batch 8
          (``generate_batch``) for the drafts batched decoding supports.

Every figure lands in ``--out``/results.json (and the log); with ``--rehearse`` everything runs on the
CPU on a tiny random target with the bundled tokenizer and a few prompts, so a lent GPU's minutes go
to measuring (tests/test_gpu_truth.py runs the rehearsal).

    python bench/gpu_truth.py --out $OUT --minutes 8.5        # on the GPU (bench/gpu_truth_device.sh)
    python bench/gpu_truth.py --rehearse --out /tmp/truth     # on the CPU, a minute or two
"""

from __future__ import annotations

import argparse
import json
import shutil
import tarfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
from benchlib.timed import (
    batched_row,
    decode_batched,
    decode_each,
    draftsmith_decoder,
    side_by_side,
    transformers_decoder,
)
from benchlib.train_speed import fit_and_train

from draftsmith.sources import BUILTIN_TRAIN

TRAIN_FILES = list(BUILTIN_TRAIN)
RECIPE = "configs/smollm2_eagle3.yaml"


def log(message: str) -> None:
    print(f"[gpu_truth] {message}", flush=True)


def rehearsal_target(path: Path) -> str:
    """A tiny random Llama with the bundled target's tokenizer and chat template, saved at ``path``.

    Random weights almost never choose the end-of-turn token, so its output row is scaled up until some
    replies end, as a real target's do: the rehearsal then meets finished and cut replies alike.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from draftsmith.loading import SMOLLM2_ALIAS, resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(SMOLLM2_ALIAS)[0])
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[eos] *= 3.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def stage_data(args, model, tokenizer, work: Path) -> dict:
    """Prompts (shipped first turns + synthesized), answered by the target with continuous batching."""
    from draftsmith.train.corpus.prompts import first_user_turns
    from draftsmith.train.corpus.regenerate import regenerate
    from draftsmith.train.corpus.synthesize import synthesize

    began = time.perf_counter()
    shipped = work / "shipped_prompts.jsonl"
    if not shipped.exists():
        rows = first_user_turns(args.train_files, args.shipped_count)
        shipped.write_text("".join(json.dumps(r) + "\n" for r in rows))
    synthesized = work / "synthesized.jsonl"
    start = time.perf_counter()
    synth = synthesize(
        model, tokenizer, synthesized, args.synth_count, batch_size=args.synth_batch, progress=False
    )
    synth_seconds = time.perf_counter() - start
    log(
        f"synthesized {synth.written} prompts in {synth_seconds:.0f} s ({synth.unfinished} unfinished dropped)"
    )
    regenerated = work / "regenerated.jsonl"
    left = max(10.0, args.data_minutes * 60 - (time.perf_counter() - began))
    start = time.perf_counter()
    regen = regenerate(
        model,
        tokenizer,
        [synthesized, shipped],
        regenerated,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.regen_batch,
        batching="continuous",
        max_seconds=left,
        progress=False,
    )
    seconds = time.perf_counter() - start
    result = {
        "synthesize": {**asdict(synth), "seconds": synth_seconds},
        "regenerate": {
            **asdict(regen),
            "seconds": seconds,
            "tokens_per_s": regen.tokens / seconds,
            "in_flight": args.regen_batch,
            "max_new_tokens": args.max_new_tokens,
        },
        "conversations_with_a_cut_reply": _flagged(regenerated),
    }
    log(
        f"regenerated {regen.written} conversations, {regen.tokens} tokens in {seconds:.0f} s "
        f"({regen.tokens / seconds:.0f} tok/s), {regen.truncated_replies} replies cut at the token budget"
    )
    return result


def _flagged(path: Path) -> int:
    return sum(bool(json.loads(line).get("truncated_replies")) for line in path.read_text().splitlines())


def stage_train(args, target, work: Path, minutes: float) -> dict:
    """The recipe on the regenerated answers for ``minutes``; the head packed into --out."""
    from benchlib.transport import pack

    overrides = [
        f"--target.spec={args.target}",
        f"--data.regenerated={work / 'regenerated.jsonl'}",
        f"--output.dir={work / 'run'}",
        "--data.pack=true",
        "--trainer.grad_accum=1",
        "--optim.lr=1.0e-3",
        "--trainer.num_workers=2",
        f"--draft.options.draft_vocab_size={args.draft_vocab}",
        *args.train_override,
    ]
    report = fit_and_train(
        RECIPE, overrides, target, minutes, probe_steps=args.probe_steps, max_steps=args.max_steps
    )
    head = work / "head"
    if head.exists():
        shutil.rmtree(head)
    parts = pack(Path(report["draft_dir"]), head, max_mb=15.0)
    report["packed_mb"] = sum(p.stat().st_size for p in parts) / 1e6
    log(f"trained {report['steps']} steps, held-out {report['val']}; packed {report['packed_mb']:.1f} MB")
    return report


def stage_decode(args, target, draft_dir: str, max_new: int) -> dict:
    """Batch 1 through eval.evaluate, eager and static + CUDA graphs; transformers' peers; batch 8."""
    from draftsmith.decode.tree import TreeSpec
    from draftsmith.drafts import build_drafter
    from draftsmith.drafts.base import EAGLE3, NGRAM
    from draftsmith.drafts.layer_subset import layer_subset_view
    from draftsmith.eval.harness import BASELINE, Method, evaluate, use_static_caches
    from draftsmith.eval.prompts import load_prompts, render
    from draftsmith.eval.report import build_report

    prompts = load_prompts(args.prompts, args.limit, order="round-robin")
    ngram, head = build_drafter(NGRAM, target), build_drafter(draft_dir, target)
    k = args.k
    settings = {}
    for setting in ("eager", "static+graphs"):
        methods = [
            Method(NGRAM, ngram, k),
            Method(EAGLE3, head, k),
            Method(f"{EAGLE3} k=auto", head, "auto"),
        ]
        if setting == "eager":
            methods.append(Method(f"{EAGLE3} tree {args.tree}", head, tree=TreeSpec.parse_policy(args.tree)))
        else:
            use_static_caches(target, [ngram, head], prompts, max_new, 8, args.compile_mode)
        start = time.perf_counter()
        result = evaluate(target, methods, prompts, k=k, max_new_tokens=max_new, progress=False)
        report = build_report(result, target.name, {"setting": setting}, "")
        settings[setting] = {"seconds": time.perf_counter() - start, **_summary(report)}
        for row in [settings[setting]["target alone"], *settings[setting]["drafts"]]:
            log(
                f"{setting:<14} {row['name']:<18} {row['tokens_per_s']:8.1f} tok/s  {row.get('speedup', 1):5.2f}x  "
                f"τ {row.get('tau', 1):.2f}  exact {row.get('exact_match', '-')}  "
                f"draft {row['draft_ms_per_step']:.2f} ms  verify {row['verify_ms_per_step']:.2f} ms per step"
            )
    target.use_static_cache(None)  # eager again: transformers' peers and batched decoding

    firsts = [render(target.tokenizer, [{"role": "user", "content": p.turns[0]}]) for p in prompts]
    assistant = layer_subset_view(target.model, args.assistant_layers)
    assistant.generation_config = type(target.model.generation_config).from_dict(
        target.model.generation_config.to_dict()
    )
    decoders = {
        f"draftsmith: {BASELINE}": draftsmith_decoder(target, None, 0),
        f"draftsmith: {EAGLE3}": draftsmith_decoder(target, head, k),
        "hf: generate": transformers_decoder(target),
        "hf: prompt_lookup": transformers_decoder(target, prompt_lookup_num_tokens=k),
        f"hf: assistant_model(layers:{args.assistant_layers})": transformers_decoder(
            target, assistant_model=assistant
        ),
    }
    peers = side_by_side(decoders, firsts[0], firsts, max_new)
    base = peers[f"draftsmith: {BASELINE}"]["tokens_per_s"]
    for name, row in peers.items():
        row["speedup_vs_target_alone"] = row["tokens_per_s"] / base
        log(
            f"peers {name:<36} {row['tokens_per_s']:8.1f} tok/s  {row['speedup_vs_target_alone']:5.2f}x  "
            f"same as target alone {row['same_as_first']}/{len(firsts)}"
        )

    reference = decode_each(target, firsts, None, 0, max_new).outputs
    batched = []
    for name, drafter in {BASELINE: None, NGRAM: ngram, EAGLE3: head}.items():
        if drafter is not None and drafter.batched(args.batch) is None:
            log(f"batch {args.batch}: {name} has no batched drafter; left out")
            continue
        decode_batched(target, firsts[: args.batch], drafter, k, args.batch, 8)  # warm-up
        row = {"method": name, **batched_row(target, firsts, reference, drafter, k, args.batch, max_new)}
        batched.append(row)
        log(
            f"batch {args.batch} {name:<14} {row['tokens_per_s']:8.1f} tok/s  τ {row['tau']:.2f}  "
            f"exact {row['exact']}/{row['prompts']}"
        )
    return {
        "prompts": len(prompts),
        "k": k,
        "settings": settings,
        "peers": {n: {key: v for key, v in r.items() if key != "outputs"} for n, r in peers.items()},
        "batched": batched,
    }


def _summary(report: dict) -> dict:
    """The figures worth keeping from an eval report: per method tok/s, τ, speedup, exact, by category,
    and per-step draft and verify milliseconds."""

    def per_step(entry: dict, steps: int) -> dict:
        steps = max(steps, 1)
        return {
            "draft_ms_per_step": 1000 * entry["draft_seconds"] / steps,
            "verify_ms_per_step": 1000 * entry["verify_seconds"] / steps,
        }

    base = report["baseline"]
    alone = {
        "name": "target alone",
        "tokens_per_s": base["tokens_per_s"],
        **per_step(base, base["target_forwards"]),
    }
    drafts = []
    for d in report["drafts"]:
        steps = sum(n for _, _, n in d["acceptance"]["steps"])
        drafts.append(
            {
                "name": d["name"],
                "tokens_per_s": d["tokens_per_s"],
                "speedup": d["speedup"],
                "tau": d["tau"],
                "per_position": d["per_position"],
                "exact_match": d["exact_match"],
                **per_step(d, steps),
                "chosen_k": d.get("chosen_k"),
                "categories": {
                    c: {"tau": v["tau"], "speedup": v["speedup"]} for c, v in d["categories"].items()
                },
            }
        )
    return {"target alone": alone, "drafts": drafts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="results.json, the log's figures, the packed head")
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu_truth"), help="data and run (resumable)")
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--minutes", type=float, default=8.5, help="wall time for all stages together")
    p.add_argument("--data-minutes", type=float, default=2.0, help="of which synthesis and regeneration")
    p.add_argument("--decode-minutes", type=float, default=2.0, help="of which kept for the decode stage")
    p.add_argument("--train-files", nargs="+", default=TRAIN_FILES)
    p.add_argument("--shipped-count", type=int, default=20000, help="first user turns of the shipped files")
    p.add_argument("--synth-count", type=int, default=8192)
    p.add_argument("--synth-batch", type=int, default=512)
    p.add_argument("--regen-batch", type=int, default=256, help="conversations in flight")
    p.add_argument("--max-new-tokens", type=int, default=512, help="longest regenerated reply")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--probe-steps", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--train-override", action="append", default=[], help="another recipe override")
    p.add_argument("--prompts", default="builtin:dev_prompts")
    p.add_argument("--limit", type=int, default=24, help="dev prompts decoded per setting")
    p.add_argument("--decode-max-new-tokens", dest="decode_max_new", type=int, default=128)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--tree", default="5,8,48", help="the head's tree (eval's --tree)")
    p.add_argument("--compile-mode", default="reduce-overhead", help="reduce-overhead = CUDA graphs; off")
    p.add_argument("--assistant-layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rehearse", action="store_true", help="the whole script on the CPU, tiny and quick")
    args = p.parse_args()
    if args.rehearse:
        args.work = args.out / "work"
        args.minutes, args.data_minutes, args.decode_minutes = 1.5, 0.3, 0.5
        args.shipped_count, args.synth_count, args.synth_batch, args.regen_batch = 30, 8, 8, 8
        args.max_new_tokens, args.draft_vocab, args.probe_steps, args.max_steps = 40, 512, 2, 3
        args.limit, args.decode_max_new, args.k, args.compile_mode, args.tree = 3, 12, 3, "off", "3,2,6"
        args.assistant_layers, args.batch = 1, 2
        args.train_override += [
            "--data.max_length=128",
            "--trainer.batch_size=2",
            "--data.heldout=2",
            "--trainer.num_workers=0",
            "--draft.options.ttt_steps=2",
        ]
    began = time.perf_counter()
    from benchlib.records import write_json

    from draftsmith.decode.target import load_target
    from draftsmith.eval.report import hardware_description

    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    if args.rehearse:
        args.target = rehearsal_target(args.work / "tiny-target")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = load_target(args.target, device=device, dtype="bfloat16" if device == "cuda" else "float32")
    results = {
        "hardware": hardware_description(target.device, target.dtype),
        "date": time.strftime("%Y-%m-%d"),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }

    def save() -> None:
        results["seconds"] = time.perf_counter() - began
        write_json(args.out / "results.json", results)

    log(results["hardware"])
    results["data"] = stage_data(args, target.model, target.tokenizer, args.work)
    save()
    minutes = args.minutes - args.decode_minutes - (time.perf_counter() - began) / 60
    results["train"] = stage_train(args, target, args.work, max(minutes, 0.2))
    save()
    results["decode"] = stage_decode(args, target, results["train"]["draft_dir"], args.decode_max_new)
    save()
    head = args.work / "head"
    for part in sorted(head.glob("head-*.safetensors")):
        shutil.copy(part, args.out / part.name)
    with tarfile.open(args.out / "meta.tar", "w") as tar:  # a call brings back 8 files: the rest in one
        for path in sorted(head.iterdir()):
            if not path.name.startswith("head-"):
                tar.add(path, arcname=path.name)
    log(f"done in {(time.perf_counter() - began) / 60:.1f} min")


if __name__ == "__main__":
    main()
