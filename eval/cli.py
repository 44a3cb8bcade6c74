"""``draftsmith eval``: measure τ, acceptance and speedup of drafts against the target alone."""

from __future__ import annotations

import argparse
from pathlib import Path

from draftsmith.eval import mirror_stats
from draftsmith.eval.report import METRICS

DESCRIPTION = """\
Run the target alone and each draft on the same prompts, in the same process, after an untimed
warm-up; print a table (draft x category: τ, α, tok/s, speedup, the speedup bound that the measured
acceptance and costs allow and the efficiency measured / bound, exact) and write DIR/report.json,
DIR/report.md and DIR/acceptance.png (per-position acceptance, τ by category); other files in DIR
are left alone.

Prompts (--prompts): JSONL, one object a line, either Spec-Bench / MT-bench records
{"question_id", "category", "turns": [user message, ...]} (a later turn continues the conversation
after the method's own answer to the previous one) or {"prompt": "...", "category": "..."}
(category optional, "default" when absent). Each turn is rendered with the target tokenizer's chat
template when it has one, else as plain text."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``eval`` subcommand; ``args.func`` runs it."""
    p = subparsers.add_parser(
        "eval",
        help="measure τ, acceptance and speedup of drafts against the target alone",
        description=DESCRIPTION,
        epilog="metrics:\n" + METRICS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--target",
        required=True,
        metavar="T",
        help="the target: a Hub id, a local model directory, a .gguf file, or the alias smollm2-135m-instruct",
    )
    p.add_argument(
        "--draft",
        dest="drafts",
        action="append",
        default=[],
        metavar="D",
        help="a draft to measure (repeat for several): ngram, ngram:N (n-gram prompt lookup, longest n = N), "
        "layers:N (the target's own first N layers), or a draft checkpoint directory / model id",
    )
    p.add_argument(
        "--server",
        default=None,
        metavar="URL",
        help="a running vLLM server (http://host:port) that serves the target with a draft (vllm serve TARGET "
        "--speculative-config ...): the prompts go to it, greedy, and its own counters (/metrics, read before "
        "and after) give the served draft's τ, α and acceptance by position, written to DIR/served.json. With "
        "--draft (the same head), draftsmith's decoder judges it too, on the same prompts, and the two are set "
        "side by side. The server must have no other traffic meanwhile",
    )
    p.add_argument(
        "--server-in-flight",
        type=int,
        default=1,
        metavar="N",
        help="requests sent to --server at once (default 1: batch 1, as draftsmith decodes)",
    )
    p.add_argument(
        "--prompts",
        required=True,
        metavar="FILE.jsonl",
        help="the prompt file (format above), or builtin:dev_prompts (the 1,194 dev prompts shipped with draftsmith)",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help="use only the first N prompts (in --order, after --categories); default: all",
    )
    p.add_argument(
        "--categories",
        default=None,
        metavar="C1,C2",
        help="comma-separated categories to keep (default: all); an unknown name is an error",
    )
    p.add_argument(
        "--order",
        choices=["file", "round-robin"],
        default="file",
        help="prompt order before --limit: file order (default), or alternating between categories so a "
        "small --limit samples each of them; both are deterministic",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        metavar="N",
        help="new tokens per turn at most (default 256)",
    )
    p.add_argument(
        "--k",
        type=_k_arg,
        default=5,
        metavar="K",
        help="draft tokens proposed per verify step at most (default 5), or 'auto': a cost model measures "
        "acceptance per position and the draft/verify costs while decoding and picks k in 0..--k-max per "
        "step (0 = plain decoding when speculation would be slower)",
    )
    p.add_argument(
        "--k-max", type=int, default=8, metavar="N", help="largest k that --k auto may pick (default 8)"
    )
    p.add_argument(
        "--tree",
        default=None,
        metavar="DEPTH,TOP_K,TOTAL",
        help="draft token trees instead of k-token chains (EAGLE-2 dynamic trees, e.g. 5,8,48): DEPTH levels, "
        "TOP_K children per expanded node and nodes expanded per level, TOTAL draft tokens verified per "
        "step; --k is then unused. TOTAL = auto picks the node budget per step (0 = plain decoding, 4 .. 64) "
        "from measured tokens/s. Every draft must draft trees (EAGLE heads, Medusa heads, ngram)",
    )
    mirror_stats.add_options(p)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="0 = greedy (default; outputs must then equal the target's, see 'exact'); > 0 = speculative sampling",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=0,
        metavar="K",
        help="sample only among the k most likely tokens (0 = off, default)",
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (1.0 = off, default)"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="S",
        help="seed of the torch.Generator created afresh for every prompt and method (sampled runs reproduce)",
    )
    p.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto = cuda when available"
    )
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="target (and draft) weights"
    )
    p.add_argument(
        "--cpu-kernels",
        choices=["auto", "packed", "stock"],
        default="auto",
        help="CPU float32 only: the kernels of the frozen linear layers of the target and the drafts. 'auto' "
        "(default) times oneDNN on weights prepacked once (decode/cpu_kernels.py) against PyTorch's stock "
        "kernels on a few steps of the target, for a plain step and for a verify pass apart, keeps the faster "
        "of each and remembers the choice per machine and target ($DRAFTSMITH_CACHE/kernels.json; the report "
        "says what each measured); 'packed' or 'stock' forces one",
    )
    p.add_argument(
        "--no-generate-baseline",
        dest="generate_baseline",
        action="store_false",
        help="leave out the target's own transformers generate (run by default, interleaved, on stock "
        "kernels: each draft's 'vs-gen' speedup is against it)",
    )
    p.add_argument(
        "--draft-weights",
        choices=["float", "int8"],
        default="float",
        help="CPU only: 'int8' runs the drafts' own linear layers on int8 weights (one scale per output row; "
        "decode/cpu_kernels.py): faster drafting for weight-bound heads (docs/studies/eagle3_cpu_stages.md). Output stays exactly the "
        "target's (the target verifies every token and is never quantized); acceptance may change a little",
    )
    p.add_argument(
        "--static-cache",
        action="store_true",
        help="preallocate the KV caches of the target and of causal-LM drafts (sized from the prompts and "
        "--max-new-tokens) instead of growing them; chain decoding only, models without sliding-window layers",
    )
    p.add_argument(
        "--compile",
        choices=["off", "default", "reduce-overhead"],
        default="off",
        help="torch.compile the decode steps of the target and of causal-LM drafts (implies --static-cache; "
        "'reduce-overhead' adds CUDA graphs). Every step width compiles once, in the warm-up if it occurs there; "
        "prompts run eagerly",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        metavar="N",
        help="untimed warm-up: a short generation per method on each of the first N prompts (default 1; 0 = none)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="a Jinja chat template to render prompts with (a target without one, or the file a draft was "
        "trained with: --target.chat_template)",
    )
    p.add_argument(
        "--truncate-prompts",
        action="store_true",
        help="a prompt that does not fit the target's context (with --max-new-tokens) keeps its last tokens, "
        "and the report counts such generations; without it such prompts are refused before anything runs",
    )
    p.add_argument(
        "--out", required=True, metavar="DIR", help="folder for report.json and report.md (created)"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the reports an earlier eval left in --out (without it, such a folder is refused)",
    )
    p.set_defaults(func=run)
    return p


def _k_arg(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k takes an integer >= 1 or 'auto', got {value!r}") from None


def _check(args: argparse.Namespace) -> list[str] | None:
    """Validate what can be checked before loading any model; return the category filter."""
    if args.tree is not None:
        from draftsmith.decode.tree import TreeSpec

        TreeSpec.parse_policy(args.tree)
    if args.k != "auto" and args.k < 1:
        raise ValueError(f"--k must be at least 1 (draft tokens per verify step) or 'auto', got {args.k}")
    if args.k_max < 1:
        raise ValueError(f"--k-max must be at least 1, got {args.k_max}")
    if args.tree is not None and (args.static_cache or args.compile != "off"):
        raise ValueError(
            "--tree verifies trees in a growing KV cache; drop --static-cache / --compile for tree runs"
        )
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    mirror_stats.check_options(args.mirror_kappa, args.mirror_gamma, args.channel_latency_ms)
    if args.warmup < 0:
        raise ValueError(f"--warmup must be 0 or more prompts, got {args.warmup}")
    if not args.drafts and not args.server:
        raise ValueError(
            "nothing to measure: pass --draft D (a draft in draftsmith's decoder) and/or --server URL"
        )
    if args.server and args.temperature != 0:
        raise ValueError(
            "--server judges greedy decoding (the server's counters of a greedy run); drop --temperature"
        )
    if args.server_in_flight < 1:
        raise ValueError(f"--server-in-flight must be at least 1, got {args.server_in_flight}")
    repeated = sorted({d for d in args.drafts if args.drafts.count(d) > 1})
    if repeated:
        raise ValueError(f"--draft {', '.join(repeated)} given more than once; name each draft once")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} exists and is not a directory; pass a directory for the reports")
    from draftsmith import files
    from draftsmith.eval.report import REPORT_FILES

    earlier = [name for name in REPORT_FILES if (Path(args.out) / name).exists()]
    if earlier and not args.overwrite:
        raise FileExistsError(
            f"--out {args.out} already holds {', '.join(earlier)} of an earlier eval; pass --overwrite to "
            "replace them, or another --out"
        )
    files.check_writable(args.out, "--out")  # before any model loads: the report is written last
    if args.categories is None:
        return None
    categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    if not categories:
        raise ValueError(f"--categories {args.categories!r} names no category; e.g. --categories code,math")
    return categories


def run(args: argparse.Namespace) -> int:
    """Load prompts, target and drafts; evaluate; print the table and write the reports."""
    from draftsmith.decode.cpu_kernels import int8_unavailable, quantize_draft_linears
    from draftsmith.decode.kernel_choice import describe
    from draftsmith.decode.sampling import Sampling
    from draftsmith.decode.target import load_target
    from draftsmith.decode.tree import TreeSpec
    from draftsmith.drafts import build_drafter
    from draftsmith.drafts.base import check_draft_files
    from draftsmith.eval.harness import Method, evaluate, use_static_caches
    from draftsmith.eval.prompts import load_prompts
    from draftsmith.eval.report import build_report, format_table, hardware_description, write_report

    categories = _check(args)
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    prompts = load_prompts(
        args.prompts, args.limit, categories, args.order
    )  # fail fast, before loading models
    served = _served_client(args) if args.server else None  # a wrong server is refused before any model loads
    if not args.drafts:
        return _judge_served(args, served, prompts, None)
    for spec in args.drafts:
        check_draft_files(spec)  # a cut-short copy fails here, not after the target has loaded
    target = load_target(args.target, device=args.device, dtype=args.dtype, chat_template=args.chat_template)
    drafts = [(spec, build_drafter(spec, target)) for spec in args.drafts]
    mirrors = mirror_stats.settings_from_options([d for _, d in drafts], args.mirror_kappa, args.mirror_gamma)
    methods = [Method(spec, d, mirror=m) for (spec, d), m in zip(drafts, mirrors)]
    if args.draft_weights == "int8":
        why = int8_unavailable(target.device)
        if why is not None:
            raise ValueError(f"--draft-weights int8: {why}; use --draft-weights float")
        quantize_draft_linears(target.model, *(drafter for _, drafter in drafts))
    kernels = use_kernels(args, target, [drafter for _, drafter in drafts])
    if args.static_cache or args.compile != "off":
        k_max = args.k_max if args.k == "auto" else args.k
        mirror_stats.refuse_compile(drafts, args.compile)
        use_static_caches(target, [d for _, d in drafts], prompts, args.max_new_tokens, k_max, args.compile)
    result = evaluate(
        target,
        methods,
        prompts,
        k=args.k,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        seed=args.seed,
        warmup=args.warmup,
        tree=TreeSpec.parse_policy(args.tree) if args.tree is not None else None,
        k_max=args.k_max,
        truncate_prompts=args.truncate_prompts,
        transformers_baseline=args.generate_baseline,
    )
    settings = {key: value for key, value in vars(args).items() if key not in ("func", "command")}
    settings["num_prompts"] = len(prompts)
    report = build_report(result, target.name, settings, hardware_description(target.device, target.dtype))
    report["kernels"] = kernels
    print(format_table(report))
    print(describe(kernels))
    for path in write_report(report, args.out):
        print(f"wrote {path}")
    if served is not None:
        return _judge_served(args, served, prompts, report)
    return 0


def use_kernels(args: argparse.Namespace, target, drafters: list) -> dict:
    """Pack the frozen linears of the target and the drafts and choose their kernels as --cpu-kernels says
    (decode/kernel_choice.py); what was chosen, for the report. --cpu-kernels packed where packing cannot
    run is refused, naming why; auto there runs stock and says why."""
    from draftsmith.decode.cpu_kernels import KernelPolicy, pack_for_decoding, packing_unavailable
    from draftsmith.decode.kernel_choice import choose_kernels

    if args.cpu_kernels == "stock":
        return {"mode": "stock", "plain": "stock", "verify": "stock"}
    why = packing_unavailable(target.device, target.dtype)
    if why is not None:
        if args.cpu_kernels == "packed":
            raise ValueError(f"--cpu-kernels packed: {why}; use --cpu-kernels auto or stock")
        return {"mode": "auto", "plain": "stock", "verify": "stock", "note": f"not packed: {why}"}
    policy = KernelPolicy()
    pack_for_decoding(target.model, *drafters, policy=policy)
    if args.cpu_kernels == "packed":
        return {"mode": "packed", "plain": "packed", "verify": "packed"}
    if args.tree is not None:
        from draftsmith.decode.tree import TreeSpec

        tree = TreeSpec.parse_policy(args.tree)  # a node budget chosen per step goes up to 64
        width = tree.total_tokens + 1 if isinstance(tree, TreeSpec) else 65
    else:
        width = (args.k_max if args.k == "auto" else args.k) + 1
    return choose_kernels(target, policy, width)


def _served_client(args: argparse.Namespace):
    """The --server client, its model checked against --target (another target is refused, naming why)."""
    from draftsmith.eval.served_acceptance import read_counters
    from draftsmith.loading import target_tokenizer
    from draftsmith.openai_client import CompletionServer, check_server

    tokenizer, config, _ = target_tokenizer(args.target, args.chat_template)
    client = CompletionServer(args.server)
    check_server(client, tokenizer, config.vocab_size)
    read_counters(client)  # a server that serves no draft is said to, before anything runs
    return client, tokenizer


def _judge_served(args: argparse.Namespace, served: tuple, prompts, report: dict | None) -> int:
    """The served draft's acceptance on ``prompts``, printed beside draftsmith's ``report`` (if any); served.json."""
    from draftsmith import files
    from draftsmith.eval.served_acceptance import judge_server, served_table

    def progress(done: int, total: int) -> None:
        print(f"served: {done}/{total} prompts", flush=True)

    client, tokenizer = served
    run = judge_server(client, tokenizer, prompts, args.max_new_tokens, args.server_in_flight, progress)
    record = {"server": client.url, "model": client.model, "max_new_tokens": args.max_new_tokens,
              "num_prompts": len(prompts), "served": run.summary()}  # fmt: skip
    if report is not None:
        record["draftsmith"] = {d["name"]: d for d in report["drafts"]}
    print(served_table(record, args.k))
    path = files.write_text(Path(args.out) / "served.json", files.json_text(record))
    print(f"wrote {path}")
    return 0
