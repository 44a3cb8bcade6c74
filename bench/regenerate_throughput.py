"""`draftsmith data regenerate` throughput, engine by engine, on the same prompts.

Every engine answers the same single-turn prompts (the first user turns of the shipped training files,
as `draftsmith data prompts` picks them), greedy, at most --max-new-tokens each, with --batch-size
conversations in flight, one engine at a time:

- ``static``, ``continuous``: the target in this process through transformers (left-padded batches,
  or transformers' continuous batching), in --dtype (``static`` is today's default on a CPU);
- ``llamacpp:q4_1``, ``llamacpp:f32``, ``llamacpp:f16``, ``llamacpp:bf16``: ``llama-server`` through the server path
  (``--engine llamacpp``'s code: token ids in, one slot per conversation in flight, one thread per
  core), on the bundled Q4_1 GGUF or a dequantized F32/F16/BF16 copy of it (server start-up not timed);
- ``vllm:bfloat16``, ``vllm:float32``: ``vllm serve`` of the target's safetensors (``--engine vllm``'s code,
  ``scripts/install_vllm.sh``), as many sequences as conversations in flight (start-up not timed).

With several --batch-size values every engine runs at each, in turn. A reference run (static, float32)
answers the prompts first, unless --no-reference; each engine's replies are compared with it text for
text. Prints a table, writes JSON.

    python bench/regenerate_throughput.py --count 256 --max-new-tokens 128 --batch-size 8
    python bench/regenerate_throughput.py --count 256 --batch-size 8 32 64 --no-reference \
        --engines static llamacpp:bf16 vllm:bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from benchlib.records import provenance, write_json

from draftsmith import llamacpp
from draftsmith.eval.report import hardware_description
from draftsmith.loading import load_causal_lm, resolve_model_path, smollm2_gguf_path
from draftsmith.openai_client import CompletionServer
from draftsmith.sources import BUILTIN_TRAIN
from draftsmith.train.corpus.prompts import first_user_turns
from draftsmith.train.corpus.regenerate import BATCHING, regenerate
from draftsmith.train.corpus.served import regenerate_served

TARGET = "smollm2-135m-instruct"
ENGINES = (*BATCHING[1:], "llamacpp:q4_1", "llamacpp:f32", "llamacpp:f16", "llamacpp:bf16", "vllm:bfloat16",
           "vllm:float32")  # fmt: skip


def replies(path: Path) -> dict[str, str]:
    return {
        r["source_id"]: r["messages"][-1]["content"] for r in map(json.loads, path.read_text().splitlines())
    }


def gguf_for(name: str, work: Path) -> Path:
    """The bundled Q4_1 GGUF, or an F32/F16/BF16 GGUF of its dequantized weights (written once into ``work``)."""
    if name == "q4_1":
        return smollm2_gguf_path()
    from draftsmith.export.gguf import write_gguf  # the app's GGUF writer (tests check llama.cpp reads it)

    path = work / f"target-{name}.gguf"
    if not path.exists():
        write_gguf(resolve_model_path(TARGET)[0], path, name, smollm2_gguf_path())
    return path


def run_transformers(mode: str, dtype: str, prompts: Path, out: Path, args) -> tuple[object, float, str]:
    model, tokenizer, _ = load_causal_lm(TARGET, "cpu", dtype)
    settings = dict(
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, progress=False, batching=mode
    )
    regenerate(model, tokenizer, [prompts], out.with_suffix(".warm"), limit=args.batch_size, **settings)
    start = time.perf_counter()
    stats = regenerate(model, tokenizer, [prompts], out, **settings)
    return stats, time.perf_counter() - start, hardware_description(model.device, model.dtype)


def run_llamacpp(quant: str, prompts: Path, out: Path, work: Path, args) -> tuple[object, float, str]:
    from draftsmith.loading import target_tokenizer

    tokenizer, config, _ = target_tokenizer(TARGET)
    gguf, slots, threads = gguf_for(quant, work), args.batch_size, os.cpu_count() or 1
    context = args.context
    with llamacpp.Server(gguf, ["-np", str(slots), "-c", str(slots * context)], threads=threads) as server:
        servers = [CompletionServer(server.url)]
        settings = dict(max_new_tokens=args.max_new_tokens, in_flight=slots, progress=False)
        regenerate_served(tokenizer, [prompts], out.with_suffix(".warm"), servers, config.vocab_size,
                          limit=args.batch_size, **settings)  # fmt: skip
        start = time.perf_counter()
        stats = regenerate_served(tokenizer, [prompts], out, servers, config.vocab_size, **settings)
        seconds = time.perf_counter() - start
    return stats, seconds, f"llama.cpp ({LLAMACPP}) {gguf.name}, {slots} slots, {threads} threads"


LLAMACPP = f"llama-cpp-python {llamacpp.LLAMACPP_PY_VERSION} sdist"


def run_vllm(dtype: str, prompts: Path, out: Path, work: Path, args) -> tuple[object, float, str]:
    from draftsmith import vllm
    from draftsmith.loading import target_tokenizer

    tokenizer, config, _ = target_tokenizer(TARGET)
    seqs = args.batch_size
    with vllm.Server(resolve_model_path(TARGET)[0], args=["--max-num-seqs", str(seqs)], dtype=dtype,
                     max_model_len=args.context, log=work / f"vllm-{dtype}-{seqs}.log") as server:  # fmt: skip
        servers = [CompletionServer(server.url)]
        settings = dict(max_new_tokens=args.max_new_tokens, in_flight=seqs, progress=False)
        regenerate_served(tokenizer, [prompts], out.with_suffix(".warm"), servers, config.vocab_size,
                          limit=seqs, **settings)  # fmt: skip
        start = time.perf_counter()
        stats = regenerate_served(tokenizer, [prompts], out, servers, config.vocab_size, **settings)
        seconds = time.perf_counter() - start
    return stats, seconds, f"vLLM {vllm.version()} {dtype}, {seqs} sequences, eager"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="+", default=list(BUILTIN_TRAIN))
    p.add_argument("--count", type=int, default=256, help="prompts answered by each engine")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, nargs="+", default=[8], help="conversations in flight, every engine (several: each in turn)")  # fmt: skip
    p.add_argument(
        "--no-reference", action="store_true", help="skip the float32 reference run and the comparison"
    )
    p.add_argument(
        "--dtype", default="bfloat16", help="the transformers engines' dtype (the reference is float32)"
    )
    p.add_argument("--context", type=int, default=2048, help="llama-server tokens per slot")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=["static", "continuous", "llamacpp:q4_1", "llamacpp:f32"])  # fmt: skip
    p.add_argument("--work", type=Path, default=None, help="where prompts, replies and GGUF copies go (default: a temp dir)")  # fmt: skip
    p.add_argument("--out", default="bench/results/regenerate_engines.json")
    args = p.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="regen-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in first_user_turns(args.data, args.count)))
    reference = work / "reference-float32.jsonl"
    batches, expected = list(args.batch_size), None
    if not args.no_reference:
        if not reference.exists():
            args.batch_size = batches[0]
            stats, seconds, _ = run_transformers("static", "float32", prompts, reference, args)
            print(f"reference (static, float32): {stats.tokens} tokens in {seconds:.0f} s", flush=True)
        expected = replies(reference)

    rows = []
    print(f"{'engine':<16}{'in flight':>10}{'replies':>8}{'tokens':>9}{'cut':>6}{'seconds':>9}{'replies/s':>10}{'tok/s':>9}{'same':>9}",
          flush=True)  # fmt: skip
    for batch, engine in ((b, e) for b in batches for e in args.engines):
        args.batch_size = batch
        out = work / f"{engine.replace(':', '-')}-{batch}.jsonl"
        out.unlink(missing_ok=True)
        if engine.startswith("llamacpp:"):
            stats, seconds, where = run_llamacpp(engine.split(":")[1], prompts, out, work, args)
        elif engine.startswith("vllm:"):
            stats, seconds, where = run_vllm(engine.split(":")[1], prompts, out, work, args)
        else:
            stats, seconds, where = run_transformers(engine, args.dtype, prompts, out, args)
        got = replies(out)
        same = None if expected is None else sum(expected.get(sid) == text for sid, text in got.items())
        row = {"engine": engine, "in_flight": batch, "where": where, "replies": stats.replies, "tokens": stats.tokens,
               "truncated_replies": stats.truncated_replies, "seconds": round(seconds, 2),
               "replies_per_s": round(stats.replies / seconds, 3), "tokens_per_s": round(stats.tokens / seconds, 2),
               "same_as_float32_reference": None if same is None else f"{same}/{len(got)}"}  # fmt: skip
        rows.append(row)
        print(f"{engine:<16}{batch:>10}{stats.replies:>8}{stats.tokens:>9}{stats.truncated_replies:>6}{seconds:>9.1f}"
              f"{row['replies_per_s']:>10.2f}{row['tokens_per_s']:>9.1f}{str(row['same_as_float32_reference']):>9}",
              flush=True)  # fmt: skip
    by = {(r["engine"], r["in_flight"]): r for r in rows}
    for r in rows:
        if ("static", r["in_flight"]) in by:
            r["replies_per_s_over_static"] = round(
                r["replies_per_s"] / by["static", r["in_flight"]]["replies_per_s"], 3
            )
    args.batch_size = batches
    write_json(args.out, {"target": TARGET, "date": time.strftime("%Y-%m-%d"), "provenance": provenance(),
                          "settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
