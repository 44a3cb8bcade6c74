"""``draftsmith data``: prepare training data. ``draftsmith data regenerate`` has the target write the replies,
``data synthesize`` the prompts, ``data prompts`` takes them from conversation files."""

from __future__ import annotations

import argparse
from pathlib import Path

from draftsmith import files
from draftsmith.loading import DTYPES

REGENERATE_HELP = """\
Self-distillation: the target writes the assistant replies to your training prompts.

For each conversation in --data (ShareGPT, messages, question/answer or instruction/input/response;
JSON list or JSONL) the system and user turns are kept and every assistant turn is replaced by the
target's own reply to the conversation so far. A draft trained on these replies learns what the target
actually says, which raises acceptance. Output: JSONL in the "messages" shape, with a "source_id"
("file name:record index") per record, ready for training (--data OUT.jsonl).

Resumable: rerun the same command after an interruption; records already in --out are skipped and new
ones appended (each is flushed as soon as it is complete, so a kill loses at most the batch in flight).

Engines (each record says which wrote it, in "generator"):
  transformers (default)  the target in this process (static batches or continuous batching)
  --server URL            any OpenAI-compatible server of the target (vLLM, SGLang, llama-server), repeatable
                          for replicas; --batch-size requests in flight per server. draftsmith renders the
                          chat template and sends token ids; the server's model is checked against --target
                          (vocabulary, tokenization of a probe text) before any work. Rows are written in
                          input order; a server that stops answering is retried with backoff, then the run
                          stops with what was written kept: rerun to resume.
  --engine llamacpp       starts llama-server on the target's GGUF (the bundled one for smollm2-135m-instruct,
                          or a .gguf --target) from `bash scripts/install_llamacpp.sh`, runs the job, stops it:
                          the replies are that GGUF's own, as a draft served beside it should learn

Chat data: tool results (roles tool, function, ipython) are kept as context, and so are assistant
messages that call tools; --system puts a system prompt first where there is none; --template-arg passes
the chat template's variables (enable_thinking=false); --reasoning strip saves replies without their
<think> block. Through --server, a conversation whose request the server refuses (HTTP 4xx) is listed with
the reason in OUT.errors and the job goes on; a rerun tries it again.

Sharding (a cluster): --shard I/N takes conversations I, I+N, I+2N, ... of the input, so N jobs (a SLURM
array, each with its own server) write disjoint files that training reads as one data set
(data.regenerated: 'regen/part-*.jsonl'). docs/TRAINING.md has a SLURM and a vLLM example.
"""


SYNTHESIZE_HELP = """\
Training prompts written by the target itself (Magpie-style self-synthesis): given only the start of
a user turn from its chat template, an instruction-tuned model writes a plausible user request. No
prompt dataset is needed, and the prompts are the kind the target expects. Only requests that end
with an end-of-turn token are kept; very short ones and duplicates are dropped.

Output: JSONL prompts ({"id", "messages": [user turn]}), the input of `draftsmith data regenerate`:

  draftsmith data synthesize --target smollm2-135m-instruct --count 800 --out runs/synth/prompts.jsonl
  draftsmith data regenerate --target smollm2-135m-instruct --data runs/synth/prompts.jsonl \\
      --out runs/synth/regenerated.jsonl --max-new-tokens 192 --batch-size 32

Resumable: rerun the same command; it appends until --count prompts are there.
"""


SOURCES_HELP = (
    "conversations: JSON/JSONL files, built-in data sets (builtin:sharegpt_1000, builtin:gsm8k_train, "
    "builtin:gpteacher_codegen; `draftsmith data list`) or datasets loaded by `datasets` "
    "(hf:ID[:SPLIT][?config=NAME&revision=REV&streaming=true&take=N], e.g. hf:HuggingFaceH4/ultrachat_200k:train_sft)"
)


def add_target_options(parser: argparse.ArgumentParser) -> None:
    """--target, --device, --dtype and --cpu-kernels: the target that writes the data."""
    parser.add_argument(
        "--target", required=True, help="Hub id, local directory, .gguf file, or smollm2-135m-instruct"
    )
    parser.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:1, ...")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="target weights; auto (default) = bfloat16 where bf16 matrix products are fast (a GPU with "
        "bf16, a CPU with AMX or AVX512-BF16), else float32",
    )
    parser.add_argument(
        "--cpu-kernels",
        choices=["packed", "stock"],
        default="packed",
        help="CPU float32: run the target's linear layers on prepacked oneDNN weights (default; "
        "decode/cpu_kernels.py) or PyTorch's stock kernels",
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="a Jinja chat template for a target without one (or to replace its own)",
    )


def load_writer(args: argparse.Namespace):
    """(model, tokenizer, name) of the target named by ``add_target_options``' arguments; ``--out``'s folder
    is checked for writing first, so a long generation never ends in a write error."""
    from draftsmith.decode.cpu_kernels import pack_linears
    from draftsmith.loading import load_causal_lm

    files.check_writable(Path(args.out).parent, f"--out {args.out}: the folder")
    if args.chat_template is not None and not Path(args.chat_template).is_file():
        raise FileNotFoundError(f"--chat-template {args.chat_template} does not exist (a Jinja template)")
    model, tokenizer, name = load_causal_lm(args.target, args.device, args.dtype)
    if args.chat_template is not None:
        tokenizer.chat_template = Path(args.chat_template).read_text(encoding="utf-8")
    if args.cpu_kernels == "packed":
        pack_linears(model)  # a no-op off the CPU or outside float32
    return model, tokenizer, name


def add_parser(subparsers) -> None:
    data = subparsers.add_parser(
        "data",
        help="prepare training data (e.g. regenerate responses with the target)",
        description="Prepare training data for drafts.",
    )
    data.set_defaults(func=lambda args: data.print_help() or 2)
    actions = data.add_subparsers(dest="data_command", metavar="ACTION")
    regen = actions.add_parser(
        "regenerate",
        help="replace the assistant replies in conversations with the target's own (self-distillation)",
        description=REGENERATE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_options(regen)
    regen.add_argument("--data", required=True, nargs="+", metavar="SOURCE", help=SOURCES_HELP)
    regen.add_argument(
        "--out", required=True, metavar="OUT.jsonl", help="output JSONL (appended to on resume)"
    )
    regen.add_argument(
        "--max-new-tokens", type=int, default=512, help="longest reply in tokens (default: 512)"
    )
    regen.add_argument(
        "--batch-size", type=int, default=8, help="conversations in flight at once (default: 8)"
    )
    regen.add_argument(
        "--batching",
        choices=["auto", "continuous", "static"],
        default="auto",
        help="continuous: transformers' continuous batching, a finished reply's row goes to the next prompt at "
        "once; static: left-padded batches that run until their longest reply ends; auto (default): "
        "continuous on a GPU, static on the CPU (faster there, see docs/studies/regeneration.md)",
    )
    regen.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples at that temperature"
    )
    regen.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N conversations")
    regen.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="stop a conversation whose prompt grows past this (default: context length - max new tokens)",
    )
    regen.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    regen.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="start no conversation after this many minutes (those in flight finish); rerun to go on",
    )
    regen.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="URL",
        help="an OpenAI-compatible server of the target (http://host:port); repeat for replicas",
    )
    regen.add_argument(
        "--engine",
        choices=ENGINES,
        default=None,
        help="transformers (default): the target in this process; llamacpp: a local llama-server on the "
        "target's GGUF; vllm: a local `vllm serve` of the target's safetensors (`bash scripts/install_vllm.sh`); "
        "server: the --server URLs (implied by --server)",
    )
    regen.add_argument(
        "--shard", default=None, metavar="I/N", help="only shard I of N (I from 0): every N-th conversation"
    )
    regen.add_argument(
        "--reasoning",
        choices=["keep", "strip"],
        default="keep",
        help="a reasoning model's <think> block in the saved replies: keep it (default; a draft for a target "
        "served thinking learns to draft the thinking too) or strip it (only the answer is saved). A reply cut "
        "inside its thinking is flagged in cut_thinking either way",
    )
    regen.add_argument(
        "--system",
        default=None,
        metavar="TEXT",
        help="a system prompt put first in every conversation that has none (train with the same: data.system)",
    )
    regen.add_argument(
        "--template-arg",
        action="append",
        default=[],
        type=template_arg,
        metavar="KEY=VALUE",
        help="a variable for the chat template, e.g. enable_thinking=false (Qwen3); repeatable. VALUE is read as "
        "JSON (true, false, numbers), else as text. Train with the same: data.template_args",
    )
    regen.set_defaults(func=run_regenerate)

    prompts = actions.add_parser(
        "prompts",
        help="single-turn prompts (each conversation's first user turn) to regenerate answers to",
        description="Write COUNT single-turn prompts: the first user turn of conversations, taken from the "
        "--data files in turn (one from each, then the next from each, ...) so every source is represented. "
        "The output is input for `draftsmith data regenerate --data OUT.jsonl`.",
    )
    prompts.add_argument("--data", required=True, nargs="+", metavar="SOURCE", help=SOURCES_HELP)
    prompts.add_argument("--count", required=True, type=int, metavar="N", help="how many prompts")
    prompts.add_argument("--out", required=True, metavar="OUT.jsonl", help="output JSONL (replaced)")
    prompts.add_argument(
        "--max-chars", type=int, default=2000, help="skip user turns longer than this (default: 2000)"
    )
    prompts.add_argument(
        "--exclude",
        nargs="+",
        default=[],
        metavar="PROMPTS.jsonl",
        help="leave out the prompts already in these files (an earlier `data prompts` output), so a second "
        "batch for `data regenerate` holds only new ones",
    )
    prompts.set_defaults(func=run_prompts)

    listing = actions.add_parser(
        "list",
        help="the data sets shipped with draftsmith (builtin:NAME) and where they are",
        description="List the built-in data sets: name, records, file. Their sources and licenses are in the "
        "README.md beside them.",
    )
    listing.set_defaults(func=run_list)

    synth = actions.add_parser(
        "synthesize",
        help="prompts written by the target itself (Magpie-style), to regenerate answers to",
        description=SYNTHESIZE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_options(synth)
    synth.add_argument("--count", required=True, type=int, metavar="N", help="how many prompts")
    synth.add_argument(
        "--out", required=True, metavar="OUT.jsonl", help="output JSONL (appended to on resume)"
    )
    synth.add_argument(
        "--max-new-tokens", type=int, default=128, help="longest request in tokens (default: 128)"
    )
    synth.add_argument("--batch-size", type=int, default=32, help="requests sampled together (default: 32)")
    synth.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default: 1.0)")
    synth.add_argument(
        "--min-chars", type=int, default=10, help="drop requests shorter than this (default: 10)"
    )
    synth.add_argument(
        "--system",
        default=None,
        help="a system prompt to put before the user turn (default: the chat template's own, if any)",
    )
    synth.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    synth.set_defaults(func=run_synthesize)


def template_arg(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` of ``--template-arg``: VALUE as JSON (true, false, 3, "x"), else as text."""
    import json

    key, equals, value = text.partition("=")
    if not equals or not key.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. enable_thinking=false")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = {"True": True, "False": False}.get(value, value)
    return key.strip(), parsed


def run_prompts(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from draftsmith.train.corpus.prompts import first_user_turns, record_ids

    if args.count < 1:
        raise ValueError(f"--count must be at least 1, got {args.count}")
    exclude = set()
    for path in map(Path, args.exclude):
        fix = "or pass to --exclude a prompts file an earlier `draftsmith data prompts` wrote"
        exclude |= record_ids(path, path.read_text(encoding="utf-8"), "id", fix)
    rows = first_user_turns(args.data, args.count, args.max_chars, exclude)
    out = files.write_text(args.out, "".join(json.dumps(r) + "\n" for r in rows))
    print(
        f"wrote {len(rows)} prompts to {out}"
        + ("" if len(rows) == args.count else f" (the files hold only {len(rows)})")
        + (f"; left out {len(exclude)} prompts of {' '.join(args.exclude)}" if exclude else "")
    )
    return 0


def run_list(args: argparse.Namespace) -> int:
    import json

    from draftsmith.sources import BUILTIN, BUILTIN_DIR, builtin_path

    for name in BUILTIN:
        path = builtin_path(name)
        with files.open_text(path) as f:
            text = f.read()
        records = len(json.loads(text)) if text.lstrip().startswith("[") else text.count("\n")
        print(f"builtin:{name:<20} {records:>6,} records  {path}")
    print(f"sources and licenses: {BUILTIN_DIR / 'README.md'}")
    return 0


def run_synthesize(args: argparse.Namespace) -> int:
    from draftsmith.train.corpus.synthesize import synthesize

    model, tokenizer, name = load_writer(args)
    stats = synthesize(
        model,
        tokenizer,
        args.out,
        args.count,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        temperature=args.temperature,
        min_chars=args.min_chars,
        system=args.system,
        seed=args.seed,
    )
    total = stats.already_done + stats.written
    print(
        f"{name}: wrote {stats.written} prompts to {args.out} ({stats.already_done} were already there); "
        f"of {stats.sampled} sampled, dropped {stats.unfinished} unfinished, {stats.too_short} too short, "
        f"{stats.duplicates} duplicates"
        + (
            ""
            if total >= args.count
            else f"; stopped at {total} of {args.count}: the sampling budget ran out"
        )
    )
    return 0


ENGINES = ("transformers", "server", "llamacpp", "vllm")


def run_regenerate(args: argparse.Namespace) -> int:
    from draftsmith.train.corpus.prompts import parse_shard
    from draftsmith.train.corpus.served import errors_path

    engine = args.engine or ("server" if args.server else "transformers")
    if engine == "server" and not args.server:
        raise ValueError("--engine server needs at least one --server URL")
    if args.server and engine != "server":
        raise ValueError(f"--server is the server engine's; drop --engine {engine} or --server")
    shard = parse_shard(args.shard) if args.shard else None
    args.template_args = dict(args.template_arg)
    if engine == "transformers":
        from draftsmith.train.corpus.regenerate import regenerate

        model, tokenizer, name = load_writer(args)
        generator = {
            "engine": "transformers",
            "weights": name,
            "dtype": str(model.dtype).removeprefix("torch."),
        }
        stats = regenerate(
            model,
            tokenizer,
            args.data,
            args.out,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            temperature=args.temperature,
            limit=args.limit,
            max_prompt_tokens=args.max_prompt_tokens,
            seed=args.seed,
            batching=args.batching,
            max_seconds=None if args.max_minutes is None else args.max_minutes * 60,
            shard=shard,
            generator=generator,
            reasoning=args.reasoning,
            system=args.system,
            template_args=args.template_args,
        )
    else:
        stats, name = run_served(args, engine, shard)
    print(
        f"{name}: wrote {stats.written} conversations to {args.out} ({stats.already_done} were already there); "
        f"{stats.replies} replies ({stats.tokens} tokens), {stats.truncated_replies} hit --max-new-tokens (flagged; training learns "
        "no end of turn after them), "
        f"{stats.cut_conversations} conversations stopped at --max-prompt-tokens"
        + (f"; {stats.left_for_later} left for a rerun (--max-minutes)" if stats.left_for_later else "")
        + (
            f"; {stats.refused} conversations the server refused (HTTP 4xx) are listed with the reasons in "
            f"{errors_path(args.out)}, and a rerun tries them again"
            if stats.refused
            else ""
        )
    )
    return 0


def run_served(args, engine: str, shard: tuple[int, int] | None):
    """``draftsmith data regenerate`` with ``--server`` URLs or ``--engine llamacpp|vllm``: (stats, target name).
    The command line's part: it starts the engine and hands ``served.regenerate_served`` the values."""
    import os
    import shlex
    import sys
    from contextlib import nullcontext

    from draftsmith import files
    from draftsmith.loading import resolve_device, resolve_dtype, resolve_model_path, target_tokenizer
    from draftsmith.openai_client import CompletionServer
    from draftsmith.train.corpus.served import SLOT_CONTEXT, regenerate_served, target_gguf

    files.check_writable(Path(args.out).parent, f"--out {args.out}: the folder")
    argv = getattr(args, "argv", None)
    resume = "rerun " + shlex.join(["draftsmith", *argv]) if argv else "run the same command again"
    if engine == "llamacpp":
        from draftsmith import llamacpp

        gguf = target_gguf(args.target)
        llamacpp.tool("llama-server")  # the install command, before the target's tokenizer loads
    elif engine == "vllm":
        from draftsmith import vllm

        vllm_version = vllm.version()  # the install command, before the target's tokenizer loads
    tokenizer, config, name = target_tokenizer(args.target, args.chat_template)
    context = min(getattr(config, "max_position_embeddings", None) or SLOT_CONTEXT, SLOT_CONTEXT)
    if engine == "vllm":
        weights = resolve_model_path(args.target)[0]
        dtype = str(resolve_dtype(args.dtype, resolve_device(args.device))).removeprefix(
            "torch."
        )  # auto: bf16 where it is fast
        print(
            f"vLLM {vllm_version}: {weights}, {args.batch_size} sequences of {context} tokens",
            file=sys.stderr,
        )
        log = Path(args.out).with_name(Path(args.out).name + ".vllm.log")
        running = vllm.Server(weights, args=["--max-num-seqs", str(args.batch_size)], log=log,
                              max_model_len=context, dtype=dtype)  # fmt: skip
        generator = {"engine": "vLLM", "weights": str(weights), "vllm": vllm_version,
                     "dtype": dtype}  # fmt: skip
    elif engine == "llamacpp":
        slots, threads = args.batch_size, os.cpu_count() or 1
        print(
            f"llama-server: {gguf.name}, {slots} slots of {context} tokens, {threads} threads",
            file=sys.stderr,
        )
        running = llamacpp.Server(gguf, ["-np", str(slots), "-c", str(slots * context)], threads=threads)
        generator = {
            "engine": "llama.cpp",
            "weights": gguf.name,
            "llama_cpp": f"llama-cpp-python {llamacpp.LLAMACPP_PY_VERSION} sdist",
        }
    else:
        running, generator = nullcontext(), {"engine": "server"}
    with running as server:
        urls = [server.url] if engine in ("llamacpp", "vllm") else args.server
        servers = [CompletionServer(url) for url in urls]
        stats = regenerate_served(
            tokenizer, args.data, args.out, servers, config.vocab_size,
            max_new_tokens=args.max_new_tokens, in_flight=args.batch_size, temperature=args.temperature,
            limit=args.limit, max_prompt_tokens=args.max_prompt_tokens, seed=args.seed, shard=shard,
            generator=generator, resume_hint=resume,
            max_seconds=None if args.max_minutes is None else args.max_minutes * 60,
            reasoning=args.reasoning, system=args.system, template_args=args.template_args,
        )  # fmt: skip
    return stats, name
