"""vLLM's own speculative decoding with draftsmith's vLLM exports, beside `draftsmith eval` of the same drafts.

On the same dev prompts (first turn, the target's chat template, the same prompt token ids in both
engines), greedy, k draft tokens per step:

  vLLM (``vllm serve`` from ``scripts/install_vllm.sh``, float32, eager, one server per setting, one at a
  time): the target alone; vLLM's own n-gram proposer (prompt lookup, n = 1..3, as draftsmith's
  ``ngram``); each EAGLE-3 head (``method: eagle3``), the Medusa heads (``medusa``), the distilled small
  draft and the layer-subset draft (``draft_model``; the subset written as a truncated copy of the
  target, which is what ``layers:N`` is: the target's first N layers, final norm and LM head) -- every
  one exported by ``draftsmith export --to vllm``. Acceptance is vLLM's own counters (``/metrics``,
  read before and after the prompts: ``eval/served_acceptance.py``), at batch 1 (one request at a time)
  and at a batch of 16 (16 requests in flight); outputs at batch 1 are compared with vLLM's target alone.
  tok/s counts generated tokens over the wall time of the pass, prompt processing included.
  draftsmith (``eval.evaluate``, float32, CPU kernels packed as ``draftsmith eval`` does): the target alone
  and the same drafts (``ngram:3``, ``layers:N``) in one run, interleaved, each at its own k; with each draft's
  drafting time per step, its speedup, the bound its acceptance and costs allow (``eval/stats.SpeedupBound``)
  and the τ it would need to break even (draft + verify cost in plain target steps).

DFlash drafts (``--dflash``) draft block size - 1 tokens; P-EAGLE heads (``--peagle``, ``parallel_drafting``)
their ``parallel_depths``; a peer pipeline's DFlash draft is read for the target first, like its EAGLE-3 heads.

Prints a table, writes JSON.

    python bench/vllm_engine.py --head runs/qs --medusa runs/medusa --small runs/distill --layers 8 \\
        --prompts builtin:dev_prompts --limit 12 --max-new-tokens 96 --k 5 --out bench/results/vllm_engine.json

Several heads: ``--head shipped=runs/qs/eagle3 hour=runs/hour/eagle3`` (NAME=DIR; a bare DIR is named by its
folder). A peer pipeline's head is read for the target first (``draftsmith export ... --target``).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from benchlib.records import bench_record, write_json

from draftsmith import files, vllm
from draftsmith.decode.cpu_kernels import pack_for_decoding
from draftsmith.decode.target import load_target
from draftsmith.draft_checkpoint import locate_checkpoint
from draftsmith.drafts import build_drafter
from draftsmith.drafts.base import DFLASH, EAGLE3, LAYERS, MEDUSA, NGRAM, PEAGLE
from draftsmith.eval.harness import Method, evaluate
from draftsmith.eval.prompts import load_prompts
from draftsmith.eval.served_acceptance import judge_server
from draftsmith.eval.stats import SpeedupBound
from draftsmith.export import export_checkpoint, import_peer_head
from draftsmith.export.eagle import VariantNotExpressed
from draftsmith.loading import resolve_model_path
from draftsmith.openai_client import CompletionServer

TARGET = "smollm2-135m-instruct"
BATCH = 16


@dataclasses.dataclass
class Setting:
    """One draft judged by both engines: its name, draftsmith's spec, vLLM's speculative config, its k."""

    name: str
    spec: str | None
    vllm_config: dict | None
    k: int


def layer_subset_model(target_dir: str, n: int, out: Path) -> Path:
    """The target's first ``n`` layers, final norm and LM head as a causal LM of its own (what ``layers:N``
    drafts with), for vLLM's ``draft_model`` method."""
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype="float32")
    model.model.layers = model.model.layers[:n]
    model.config.num_hidden_layers = n
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:n]

    def save(tmp: Path) -> None:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(target_dir).save_pretrained(tmp)

    return files.replace_dir(out, save)


def named(dirs: list[str] | None) -> list[tuple[str, str]]:
    """``[NAME=]DIR`` arguments as (name, dir); a bare DIR is named by its folder."""
    return [tuple(d.split("=", 1)) if "=" in d else (Path(d).name, d) for d in dirs or ()]


def served_folder(ckpt, own: Path | None, out: Path) -> Path:
    """The folder vLLM serves a draft from: draftsmith's vLLM export of it, or, for a peer pipeline's head
    whose EAGLE-3 variant that layout does not express (``export/eagle.check_exportable``: speculators'
    ``norm_output``, ModelOpt's input norm on the fused feature), the folder the pipeline wrote. vLLM reads
    those itself (speculators' format, ModelOpt's ``export_speculative_decoding``), as the pipeline's own
    users serve them; an own export vLLM cannot read fails in vLLM, saying so."""
    if (out / "config.json").is_file():
        return out
    try:
        export_checkpoint(ckpt, "vllm", out)
    except VariantNotExpressed:
        if own is None:
            raise
        return own
    return out


def settings(args, target_dir: str, work: Path) -> list[Setting]:
    """Every draft, exported for vLLM under ``work``, with its vLLM speculative config."""
    found = [Setting("alone", None, None, 0)]
    if not args.no_ngram:
        found.append(Setting(NGRAM, f"{NGRAM}:3", {"method": "ngram", "num_speculative_tokens": args.k,
                                                   "prompt_lookup_max": 3, "prompt_lookup_min": 1}, args.k))  # fmt: skip
    drafts = [(f"{EAGLE3}:{n}", r) for n, r in named(args.head)]
    drafts += [(MEDUSA, args.medusa)] if args.medusa else []
    drafts += [("small", args.small)] if args.small else []
    drafts += [(f"{DFLASH}:{n}", r) for n, r in named(args.dflash)]
    drafts += [(f"{PEAGLE}:{n}", r) for n, r in named(args.peagle)]
    for name, run in drafts:
        ckpt = locate_checkpoint(run)
        own = ckpt.draft_dir if ckpt.kind.read_for is not None else None
        if own is not None:  # a peer pipeline's draft: read for the target first
            ckpt = import_peer_head(ckpt, target_dir, work / f"{name.replace(':', '-')}-read")
        out = served_folder(ckpt, own, work / f"{name.replace(':', '-')}-vllm")
        method = {"eagle": "eagle3", "peagle": "eagle3", "medusa": "medusa", "causal_lm": "draft_model",
                  "dflash": "dflash", "dspark": "dspark"}[ckpt.kind.family.name]  # fmt: skip
        k = min(args.k, int(ckpt.config.get("num_heads", args.k))) if method == "medusa" else args.k
        blocks = method in ("dflash", "dspark")
        k = int(ckpt.config["block_size"]) - 1 if blocks else k  # vLLM drafts whole blocks
        config = {"method": method, "model": str(out.resolve()), "num_speculative_tokens": k}
        if out == own:
            print(f"vLLM {name}: served from its pipeline's own export {own}", flush=True)
        if ckpt.kind.name == PEAGLE:  # the whole chain in one forward, as trained
            k = config["num_speculative_tokens"] = int(ckpt.config["parallel_depths"])
            config["parallel_drafting"] = True
        found.append(Setting(name, str(ckpt.draft_dir), config, k))
    if args.layers:
        out = layer_subset_model(target_dir, args.layers, work / f"layers-{args.layers}-vllm")
        found.append(Setting(f"{LAYERS}:{args.layers}", f"{LAYERS}:{args.layers}",
                             {"method": "draft_model", "model": str(out.resolve()), "num_speculative_tokens": args.k},
                             args.k))  # fmt: skip
    return found


def run_draftsmith(args, prompts, found: list[Setting]) -> tuple[dict, list[list[int]], object]:
    """draftsmith's decoder on the same prompts: the target alone and every draft, at each draft's k."""
    target = load_target(TARGET, device="cpu", dtype="float32")
    drafts = [(s, build_drafter(s.spec, target)) for s in found if s.spec]
    pack_for_decoding(target.model, *(d for _, d in drafts))
    methods = [Method(s.name, d, k=s.k) for s, d in drafts]  # one run, interleaved, each draft at its own k
    result = evaluate(target, methods, prompts, k=args.k, max_new_tokens=args.max_new_tokens, warmup=1)
    base = result.baseline.total.timing.tokens_per_s
    rows = {"alone": {"tokens_per_s": base, "tokens": result.baseline.total.timing.new_tokens}}
    for d, m in zip(result.drafts, methods):
        a, t = d.total.acceptance, d.total.timing
        bound = SpeedupBound.measure(d.total, result.baseline.total)
        rows[d.name] = {"k": m.k, "tokens": t.new_tokens, "tokens_per_s": t.tokens_per_s, "tau": a.tau,
                        "tau_drafting": a.tau_drafting, "steps": a.num_steps,
                        "steps_drafting": a.num_steps - a.chain_lengths.get(0, 0),
                        "alpha": a.alpha, "per_position": a.per_position, "speedup": t.tokens_per_s / base,
                        "draft_ms_per_step": 1e3 * t.draft_seconds / max(a.num_steps, 1),
                        "verify_ms_per_step": 1e3 * t.verify_seconds / max(a.num_steps, 1),
                        # in plain target steps: bound = E / (draft + verify), so a step must commit
                        # draft + verify tokens on average for the draft to break even
                        "speedup_bound": None if bound is None else bound.speedup,
                        "tau_to_break_even": None if bound is None else bound.draft_cost + bound.verify_cost,
                        "exact_match": d.exact_match}  # fmt: skip
    return rows, [o[0] for o in result.baseline.outputs], target


def run_vllm(args, prompts, target_dir: str, found: list[Setting], work: Path) -> dict:
    """Each setting in its own ``vllm serve``, one at a time: a warm-up, the prompts at batch 1, then at 16."""
    from draftsmith.loading import target_tokenizer

    tokenizer = target_tokenizer(TARGET)[0]
    rows = {}
    for s in found:
        log = work / f"server-{s.name.replace(':', '-')}.log"
        started = time.perf_counter()
        with vllm.Server(target_dir, s.vllm_config, log=log, kv_cache_gib=args.kv_cache_gib) as server:
            up = time.perf_counter() - started
            client = CompletionServer(server.url)
            client.model = client.models()[0]["id"]
            client.greedy_ids(tokenizer("Hello")["input_ids"], 8)  # untimed warm-up
            one = judge_server(
                client, tokenizer, prompts, args.max_new_tokens, 1, counted=s.vllm_config is not None
            )
            many = judge_server(client, tokenizer, prompts, args.max_new_tokens, BATCH,
                                counted=s.vllm_config is not None)  # fmt: skip
        rows[s.name] = {"k": s.k, "speculative_config": s.vllm_config, "start_seconds": up,
                        "batch_1": one.summary(), f"batch_{BATCH}": many.summary(),
                        "outputs": [o[0] for o in one.outputs],
                        "outputs_batch_16_equal_batch_1": many.outputs == one.outputs}  # fmt: skip
        print(
            f"vLLM {s.name}: up in {up:.0f} s, {one.summary().get('tau', 1.0):.3f} τ at batch 1", flush=True
        )
    alone = rows["alone"]
    for row in rows.values():
        row["exact_match"] = row["outputs"] == alone["outputs"]
        for batch in ("batch_1", f"batch_{BATCH}"):
            row[batch]["speedup"] = row[batch]["tokens_per_s"] / alone[batch]["tokens_per_s"]
    return rows


def print_table(ds: dict, vl: dict) -> None:
    def f(x, spec=".3f"):
        return "-" if x is None or x != x else format(x, spec)

    def rates(xs):
        return " ".join(f(x, ".2f") for x in xs or [])

    print(f"\n{'draft':<22} {'k':>2} {'τ draftsmith*':>13} {'τ vLLM':>7} {'Δ':>7}  {'by position: draftsmith':<30} "
          f"{'vLLM':<30} {'= alone':>7} {'draft ms':>8} {'ds ×':>5} {'bound':>5} {'τ even':>6} "
          f"{'tok/s b1':>8} {'× b1':>5} {'× b16':>5}")  # fmt: skip
    for name in vl or ds:  # without vLLM (--no-vllm): draftsmith's rows, vLLM's columns empty
        v, d = vl.get(name, {}), ds.get(name, {})
        b1, b16 = v.get("batch_1", {}), v.get(f"batch_{BATCH}", {})
        # vLLM's mean acceptance length counts steps that drafted: draftsmith's τ over the same kind of step
        tau_d, tau_v = (1.0, 1.0) if name == "alone" else (d.get("tau_drafting"), b1.get("tau"))
        delta = None if tau_d is None or tau_v is None else tau_v - tau_d
        print(f"{name:<22} {v.get('k', d.get('k', 0)):>2} {f(tau_d):>13} {f(tau_v):>7} {f(delta, '+.3f'):>7}  "
              f"{rates(d.get('per_position')):<30} {rates(b1.get('per_position')):<30} "
              f"{str(v.get('exact_match', d.get('exact_match'))):>7} "
              f"{f(d.get('draft_ms_per_step'), '.1f'):>8} {f(d.get('speedup'), '.2f'):>5} "
              f"{f(d.get('speedup_bound'), '.2f'):>5} {f(d.get('tau_to_break_even'), '.2f'):>6} "
              f"{f(b1.get('tokens_per_s'), '.1f'):>8} {f(b1.get('speedup'), '.2f'):>5} {f(b16.get('speedup'), '.2f'):>5}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", nargs="+", metavar="[NAME=]DIR", help="EAGLE-3 heads (draftsmith's or a peer's)")
    p.add_argument("--medusa", help="Medusa heads: run or draft directory")
    p.add_argument("--small", help="distilled small draft: run or draft directory")
    p.add_argument(
        "--dflash", nargs="+", metavar="[NAME=]DIR", help="DFlash or DSpark drafts (k = their block size - 1)"
    )
    p.add_argument(
        "--peagle", nargs="+", metavar="[NAME=]DIR", help="P-EAGLE heads (k = their parallel_depths)"
    )
    p.add_argument("--no-ngram", action="store_true", help="leave out the n-gram setting")
    p.add_argument(
        "--layers", type=int, default=None, metavar="N", help="also the layer-subset draft layers:N"
    )
    p.add_argument("--prompts", default="builtin:dev_prompts")
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--order", default="round-robin")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--kv-cache-gib", type=int, default=4, help="vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--work", default="runs/vllm", help="folder for the exports and the server logs")
    p.add_argument("--out", default="bench/results/vllm_engine.json")
    p.add_argument(
        "--no-vllm", action="store_true",
        help="draftsmith's decoder alone (the dev judge of drafts vLLM's CPU build cannot serve, e.g. DSpark)",
    )  # fmt: skip
    args = p.parse_args()
    version = None if args.no_vllm else vllm.version()  # names the install command when there is no vLLM
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    target_dir = resolve_model_path(TARGET)[0]
    prompts = [dataclasses.replace(q, turns=q.turns[:1])
               for q in load_prompts(args.prompts, args.limit, None, args.order)]  # fmt: skip
    found = settings(args, target_dir, work)
    ds_rows, ds_outputs, target = run_draftsmith(args, prompts, found)
    vl_rows = {} if args.no_vllm else run_vllm(args, prompts, target_dir, found, work)
    print_table(ds_rows, vl_rows)
    same = sum(a == b for a, b in zip(vl_rows["alone"]["outputs"], ds_outputs)) if vl_rows else 0
    print(
        "* τ over the verify steps that drafted, as vLLM counts its mean acceptance length (eval/stats tau_drafting)"
    )
    print(
        "draft ms: draftsmith's drafting per verify step; ds ×: its speedup over the target alone, bound: what its "
        "acceptance and costs allow, τ even: the tokens a step must commit to break even at its costs"
    )
    if vl_rows:
        print(
            f"vLLM target alone vs draftsmith float32 target alone: {same}/{len(prompts)} outputs identical"
        )
    settings_record = vars(args) | {"num_prompts": len(prompts), "greedy": True, "vllm": version}
    write_json(args.out, bench_record(target, settings_record, draftsmith=ds_rows, vllm=vl_rows,
                                      vllm_alone_equals_draftsmith_alone=f"{same}/{len(prompts)}" if vl_rows else None))  # fmt: skip


if __name__ == "__main__":
    main()
