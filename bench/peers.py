"""draftsmith's decoder against transformers' own speculative paths, same prompts, same process.

Runs, greedy and batch 1, on the first N dev prompts:
  hf:generate                 transformers `generate` alone
  hf:prompt_lookup            `generate(prompt_lookup_num_tokens=k)`
  hf:assisted(layers:N)       `generate(assistant_model=<the target's first N layers>)`
  ds:baseline                 draftsmith's loop with k = 0
  ds:ngram                    draftsmith's n-gram drafter
  ds:layers:N                 draftsmith's layer-subset drafter (the same draft as hf:assisted)
  hf:assisted(NAME), ds:NAME  with --assistant DIR: a saved draft (e.g. distilled) in both decoders
Every method warms up on one prompt first, then all run interleaved prompt by prompt
(``benchlib.timed.side_by_side``). Prints a table, writes JSON.

    python bench/peers.py --prompts builtin:dev_prompts --limit 12 --out bench/results/peers.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchlib.records import write_json
from benchlib.timed import draftsmith_decoder, side_by_side, transformers_decoder
from transformers import AutoModelForCausalLM

from draftsmith.decode.cost_model import CostModel
from draftsmith.decode.cpu_kernels import pack_for_decoding
from draftsmith.decode.target import load_target
from draftsmith.drafts import build_drafter
from draftsmith.drafts.base import LAYERS, NGRAM
from draftsmith.drafts.layer_subset import layer_subset_view
from draftsmith.eval.prompts import load_prompts, render
from draftsmith.eval.report import hardware_description


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", default="builtin:dev_prompts")
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=5, help="draft length for every speculative method")
    parser.add_argument("--layers", type=int, default=8, help="depth of the layer-subset draft")
    parser.add_argument(
        "--assistant",
        action="append",
        default=[],
        metavar="DIR",
        help="a draft directory (e.g. a distilled small draft) run both as hf:assisted and through "
        "draftsmith's decoder; repeatable",
    )
    parser.add_argument(
        "--cpu-kernels",
        choices=["packed", "stock"],
        default="packed",
        help="packed (default): every model here, transformers' and draftsmith's alike, runs its linear "
        "layers through prepacked oneDNN weights (decode/cpu_kernels.py); stock: PyTorch's defaults",
    )
    parser.add_argument("--out", default="bench/results/peers.json")
    args = parser.parse_args()

    target = load_target(args.target, device="auto", dtype="float32")
    # first turns only: transformers' generate has no notion of a second turn built on its own answer
    prompts = [
        render(target.tokenizer, [{"role": "user", "content": p.turns[0]}])
        for p in load_prompts(args.prompts, args.limit + 1)
    ]
    warmup, prompts = prompts[0], prompts[1:]
    assistant = layer_subset_view(target.model, args.layers)
    assistant.generation_config = type(target.model.generation_config).from_dict(
        target.model.generation_config.to_dict()
    )
    drafters = {
        spec: build_drafter(spec, target) for spec in [NGRAM, f"{LAYERS}:{args.layers}", *args.assistant]
    }
    methods = {
        "hf:generate": transformers_decoder(target),
        "hf:prompt_lookup": transformers_decoder(target, prompt_lookup_num_tokens=args.k),
        f"hf:assisted(layers:{args.layers})": transformers_decoder(target, assistant_model=assistant),
        "ds:baseline": draftsmith_decoder(target, None, 0),
        f"ds:{NGRAM}": draftsmith_decoder(target, drafters[NGRAM], args.k),
        f"ds:{LAYERS}:{args.layers}": draftsmith_decoder(target, drafters[f"{LAYERS}:{args.layers}"], args.k),
    }
    models = [target.model, assistant, *drafters.values()]
    for path in args.assistant:  # the same saved draft in both decoders
        model = AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype).to(target.device)
        model.eval().requires_grad_(False)
        model.generation_config = assistant.generation_config
        models.append(model)
        name = Path(path).parent.name if Path(path).name == "draft" else Path(path).name
        methods[f"hf:assisted({name})"] = transformers_decoder(target, assistant_model=model)
        methods[f"ds:{name}"] = draftsmith_decoder(target, drafters[path], args.k)
        # transformers adapts its assistant's draft length; draftsmith's counterpart is the cost model
        methods[f"ds:{name}(k=auto)"] = draftsmith_decoder(target, drafters[path], CostModel(k_max=args.k))
    if args.cpu_kernels == "packed":
        pack_for_decoding(*models)
    rows = side_by_side(methods, warmup, prompts, args.max_new_tokens)
    for name, row in rows.items():
        print(
            f"{name:28s} {row['tokens_per_s']:7.2f} tok/s  ({row['tokens']} tokens, {row['seconds']:.1f} s, "
            f"{row['same_as_first']}/{len(prompts)} outputs identical to hf:generate)",
            flush=True,
        )

    base = rows["hf:generate"]["tokens_per_s"]
    print(f"\n{'method':28s} {'tok/s':>8s} {'vs hf:generate':>15s}")
    for name, row in rows.items():
        row["ratio_vs_hf_generate"] = row["tokens_per_s"] / base
        print(f"{name:28s} {row['tokens_per_s']:8.2f} {row['ratio_vs_hf_generate']:14.2f}x")
    result = {
        "target": target.name,
        "settings": vars(args) | {"num_prompts": len(prompts), "greedy": True, "dtype": "float32"},
        "hardware": hardware_description(target.device, target.dtype),
        "date": time.strftime("%Y-%m-%d"),
        "methods": {name: {k: v for k, v in row.items() if k != "outputs"} for name, row in rows.items()},
    }
    write_json(args.out, result)


if __name__ == "__main__":
    main()
