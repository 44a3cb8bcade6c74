"""The prompts of a peer-training pool as chat records, for ``draftsmith data regenerate``.

``bench/peer_training.py``'s data stage writes the conversations draftsmith's sampler trains on first
(``WORK/data/train.jsonl``: token ids and loss masks, chat template applied). The issue's first ablation
asks for "the target's own answers at equal tokens, regenerated from the same prompts": this turns those
conversations back into ``{"messages": [...]}`` records (system, user and assistant turns; the assistant
turns are what regeneration replaces), so the regenerated pool has the same prompts in the same order.
A conversation cut by ``max_length`` loses its unfinished last turn (an assistant turn would be replaced
anyway; a user turn without its reply has nothing to regenerate).

    python bench/regen_pool.py --work runs/sweep_400k --out runs/regen_400k/prompts.jsonl
    draftsmith data regenerate --target smollm2-135m-instruct --engine vllm --data runs/regen_400k/prompts.jsonl \
        --out runs/regen_400k/regenerated.jsonl --max-new-tokens 384 --batch-size 64
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from peerbench.common import TARGET

TURN = re.compile(r"<\|im_start\|>(system|user|assistant)\n(.*?)(<\|im_end\|>|$)", re.DOTALL)


def messages_of(text: str) -> list[dict[str, str]]:
    """The finished turns of one rendered ChatML conversation (SmolLM2's template)."""
    turns = [
        {"role": role, "content": content} for role, content, end in TURN.findall(text) if end == "<|im_end|>"
    ]
    while turns and turns[-1]["role"] != "assistant":
        turns.pop()
    return turns


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--work", type=Path, required=True, help="a peer_training.py --work folder after its data stage"
    )
    p.add_argument("--out", type=Path, required=True, help="JSONL of {'messages': [...]} records")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from draftsmith import files
    from draftsmith.loading import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(TARGET)[0])
    records, dropped = [], 0
    for line in (args.work / "data" / "train.jsonl").read_text().splitlines():
        text = tokenizer.decode(json.loads(line)["input_ids"], skip_special_tokens=False)
        messages = messages_of(text)
        if any(m["role"] == "user" for m in messages):
            records.append({"messages": messages})
        else:
            dropped += 1
    files.write_text(args.out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    print(
        f"wrote {len(records)} conversations to {args.out} ({dropped} without a finished user turn and reply)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
