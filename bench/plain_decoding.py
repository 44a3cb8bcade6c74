"""Plain decoding (the target alone, no draft) in draftsmith's decoder against transformers' generate and the limit.

Every speedup draftsmith reports divides by its own "target alone" run, so that run must be as fast as what a
user would run instead. On the same prompts (first turns of the dev prompts, round-robin over categories,
chat template, greedy, float32), warmed up and then interleaved prompt by prompt in one process:

- draftsmith's decoder with the kernels ``draftsmith eval`` picks by default (``--cpu-kernels auto``:
  decode/kernel_choice.py, measured afresh here), and with each kernel forced (packed, stock);
- transformers' ``generate`` (dynamic cache, and ``cache_implementation="static"``) on stock kernels;
- llama.cpp's ``llama-server`` (where ``scripts/install_llamacpp.sh`` built it) on the bundled Q4_1 GGUF and on
  an F32 GGUF of the same dequantized weights, one server each, greedy ``/completion`` from the same token ids
  (timed as the others are, wall clock per call, HTTP included);
- vLLM's CPU build (where ``scripts/install_vllm.sh`` installed it) serving the same float32 weights, one request at
  a time (batch 1), greedy ``/v1/completions`` from the same token ids, its token ids returned (eager mode, as
  draftsmith's vLLM judging runs it);

beside the memory-bandwidth ceiling of this machine: the bytes of weights one token reads (every parameter
once; the tied embedding read once, as the LM head; a GGUF's file size for llama.cpp's rows) over the read
bandwidth measured here (the best of a few sums over a buffer far larger than the caches, 2 threads). Prints
a table, writes JSON.

    python bench/plain_decoding.py --prompts 16 --max-new-tokens 64 --out bench/results/plain_decoding.json
"""

from __future__ import annotations

import argparse
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path

import torch
from benchlib.records import bench_record, write_json
from benchlib.timed import draftsmith_decoder, side_by_side, transformers_decoder

from draftsmith import llamacpp, vllm
from draftsmith.decode.cpu_kernels import KernelPolicy, pack_for_decoding, stock_kernels
from draftsmith.decode.kernel_choice import choose_kernels, describe
from draftsmith.decode.target import load_target
from draftsmith.eval.prompts import load_prompts, render
from draftsmith.export.gguf import write_gguf
from draftsmith.loading import resolve_model_path, smollm2_gguf_path
from draftsmith.openai_client import CompletionServer


def read_bandwidth(gib: float = 2.0, repeats: int = 5) -> float:
    """Bytes per second that a sum over a ``gib`` GiB float32 buffer reads (the best of ``repeats``)."""
    buffer = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of distinct parameters (a tied embedding counted once)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def on(kernel_context, run):
    """``run`` with ``kernel_context()`` around every call."""

    def decode(prompt, max_new_tokens):
        with kernel_context():
            return run(prompt, max_new_tokens)

    return decode


def llamacpp_decoders(stack: ExitStack, work: Path, threads: int) -> tuple[dict, dict[str, int]]:
    """llama-server on the bundled Q4_1 GGUF and on an F32 GGUF of the same weights (written once into
    ``work``), each up for the length of ``stack``: decoders for ``side_by_side`` and each one's GGUF bytes."""
    work.mkdir(parents=True, exist_ok=True)
    files = {"q4_1": smollm2_gguf_path(), "f32": work / "target-f32.gguf"}
    if not files["f32"].exists():
        write_gguf(resolve_model_path("smollm2-135m-instruct")[0], files["f32"], "f32", files["q4_1"])
    decoders, sizes = {}, {}
    for quant, path in files.items():
        server = stack.enter_context(llamacpp.Server(path, llamacpp.speculative_args(None, 0), threads))

        def decode(prompt, max_new_tokens, server=server):
            return server.complete(prompt.tolist(), max_new_tokens)["tokens"]

        name = f"llama.cpp {quant.upper()}"
        decoders[name], sizes[name] = decode, path.stat().st_size
    return decoders, sizes


def vllm_decoder(stack: ExitStack, model: str, threads: int):
    """vLLM serving ``model`` (float32, eager) for the length of ``stack``: a decoder for ``side_by_side``."""
    server = stack.enter_context(vllm.Server(model, threads=threads))
    client = CompletionServer(server.url)
    client.model = client.models()[0]["id"]

    def decode(prompt, max_new_tokens):
        return client.greedy_ids(prompt.tolist(), max_new_tokens)

    return decode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=16, help="dev prompts (first turns, round-robin)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=5, help="the verify width the kernel choice is made for is k + 1")
    p.add_argument("--out", default="bench/results/plain_decoding.json")
    p.add_argument("--no-llamacpp", action="store_true", help="leave out llama.cpp's rows (else they run where "
                   "scripts/install_llamacpp.sh built llama-server, and are left out with a word where not)")  # fmt: skip
    p.add_argument("--no-vllm", action="store_true", help="leave out vLLM's row (else it runs where "
                   "scripts/install_vllm.sh installed vLLM, and is left out with a word where not)")  # fmt: skip
    p.add_argument(
        "--work", type=Path, default=Path("runs/plain_decoding"), help="where the F32 GGUF is kept"
    )
    args = p.parse_args(argv)
    if args.target != "smollm2-135m-instruct" and not args.no_llamacpp:
        p.error("llama.cpp's rows need the bundled target's GGUF: give --no-llamacpp for another target")

    target = load_target(args.target, device="cpu", dtype="float32")
    prompts = [
        render(target.tokenizer, [{"role": "user", "content": q.turns[0]}])
        for q in load_prompts("builtin:dev_prompts", args.prompts, None, "round-robin")
    ]
    policy = KernelPolicy()
    pack_for_decoding(target.model, policy=policy)
    choice = choose_kernels(target, policy, args.k + 1, remeasure=True)
    print(describe(choice))
    chosen = (choice["plain"], choice["verify"])

    def auto():
        policy.plain, policy.verify = chosen
        return nullcontext()

    ours = draftsmith_decoder(target, None, 0)
    decoders = {
        "draftsmith, auto kernels": on(auto, ours),
        "draftsmith, packed": on(lambda: policy.forced("packed"), ours),
        "draftsmith, stock": on(lambda: policy.forced("stock"), ours),
        "transformers generate": on(lambda: stock_kernels(target.model), transformers_decoder(target)),
        "transformers generate, static cache": on(
            lambda: stock_kernels(target.model), transformers_decoder(target, cache_implementation="static")
        ),
    }
    per_token = weight_bytes(target.model)
    bytes_read = dict.fromkeys(decoders, per_token)
    with ExitStack() as stack:
        if args.no_llamacpp:
            print("llama.cpp: left out (--no-llamacpp)")
        elif not llamacpp.available():
            print(
                "llama.cpp: llama-server not built (bash scripts/install_llamacpp.sh); its rows are left out"
            )
        else:
            served, sizes = llamacpp_decoders(stack, args.work, torch.get_num_threads())
            decoders |= served
            bytes_read |= sizes
        if args.no_vllm:
            print("vLLM: left out (--no-vllm)")
        elif not vllm.available():
            print(f"vLLM: not installed ({vllm.INSTALL}); its row is left out")
        else:
            decoders["vLLM CPU, batch 1"] = vllm_decoder(
                stack, resolve_model_path(args.target)[0], torch.get_num_threads()
            )
            bytes_read["vLLM CPU, batch 1"] = per_token
        rows = side_by_side(decoders, prompts[0], prompts, args.max_new_tokens)
    bandwidth = read_bandwidth()
    ceiling = bandwidth / per_token
    generate = rows["transformers generate"]["tokens_per_s"]
    print(
        f"\nweights {per_token / 1e6:.0f} MB a token; read bandwidth {bandwidth / 1e9:.1f} GB/s; ceiling {ceiling:.1f} tok/s "
        "(of ceiling: each row against its own weights' bytes)"
    )
    print(f"{'decoder':38s}{'tok/s':>8}{'vs generate':>13}{'of ceiling':>12}{'same as first':>15}")
    for name, row in rows.items():
        row["vs_generate"] = row["tokens_per_s"] / generate
        row["weight_bytes"] = bytes_read[name]
        row["of_ceiling"] = row["tokens_per_s"] / (bandwidth / bytes_read[name])
        print(f"{name:38s}{row['tokens_per_s']:8.1f}{row['vs_generate']:13.2f}{row['of_ceiling']:12.2f}"
              f"{row['same_as_first']:>10}/{len(prompts)}")  # fmt: skip
        del row["outputs"]
    settings = {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "k": args.k,
                "llamacpp": not args.no_llamacpp, "vllm": not args.no_vllm}  # fmt: skip
    write_json(args.out, bench_record(target, settings, rows=rows, kernels=choice, weight_bytes=per_token,
                                      read_bandwidth_bytes_per_s=bandwidth, ceiling_tokens_per_s=ceiling))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
