"""Shared by the peer drivers (run as scripts from this folder): arguments, per-step timestamps, the result file.

Every peer steps a ``torch.optim.Optimizer``, so one global post-step hook times them all alike,
without touching their training loops.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from torch.optim.optimizer import register_optimizer_step_post_hook


def record_steps() -> list[tuple[float, float]]:
    """A list that gets (wall, process CPU) seconds appended after every optimizer step in this process.

    Only the first optimizer that steps is counted (speculators steps Muon and AdamW each step).
    """
    marks: list[tuple[float, float]] = []
    first: list[int] = []

    def hook(optimizer, *_):
        if not first:
            first.append(id(optimizer))
        if id(optimizer) == first[0]:
            marks.append((time.perf_counter(), time.process_time()))

    register_optimizer_step_post_hook(hook)
    return marks


def counted(collate, tokens: list[int], positions: list[int], mask_key: str = "attention_mask"):
    """``collate`` that also appends each batch's real tokens (``mask_key`` ones) to ``tokens`` and the
    positions it computes (padding included) to ``positions``, in the order the batches are made."""

    def collate_counting(*args):
        out = collate(*args)
        mask = out[mask_key]
        tokens.append(int(mask.sum()))
        positions.append(int(mask.numel()))
        return out

    return collate_counting


def loaded_distributions() -> dict[str, str]:
    """Installed distributions (name: version) whose top-level modules this process imported: what the run used."""
    import sys
    from importlib.metadata import packages_distributions, version

    owners = packages_distributions()
    names = {d for m in list(sys.modules) for d in owners.get(m.partition(".")[0], [])}
    return {name: version(name) for name in sorted(names)}


def write_result(out: Path, marks: list, head: Path | None, **fields) -> None:
    """``out/result.json``: the step marks, the exported head, what else the driver read, the packages it used."""
    record = {"step_marks": marks, "head": str(head) if head else None, **fields}
    record["distributions"] = loaded_distributions()
    (out / "result.json").write_text(json.dumps(record, indent=1, default=str))


def driver_args() -> tuple[argparse.Namespace, dict]:
    """(``--work``, ``--out``, ``--draft``, ``--offline`` and the ``--override`` pairs as the benches pass them,
    the bench's budget); ``--out`` made."""
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=Path, required=True, help="the bench's folder: data/, the captures")
    p.add_argument("--out", type=Path, required=True, help="this run's folder: result.json, the head")
    p.add_argument("--draft", choices=("eagle3", "dflash"), default="eagle3", help="the draft kind to train")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="one of the peer's own settings, in its own words (repeatable; see the driver)")  # fmt: skip
    p.add_argument("--offline", type=Path, default=None, metavar="DIR",
                   help="train from the features in DIR, written in this pipeline's own offline layout by "
                   "bench/step_like_for_like.py (ModelOpt, draftsmith; SpecForge and speculators always do)")  # fmt: skip
    args = p.parse_args()
    args.override = [tuple(item.split("=", 1)) for item in args.override]
    args.out.mkdir(parents=True, exist_ok=True)
    return args, json.loads((args.work / "data" / "budget.json").read_text())


def json_value(text: str):
    """A setting's value as the peer's config holds it: a number, a boolean or null where it reads as one."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def set_dotted(config: dict, key: str, value: str) -> None:
    """``config[a][b] = value`` for ``key`` ``a.b`` (sections made as needed)."""
    *path, last = key.split(".")
    for part in path:
        config = config.setdefault(part, {})
    config[last] = json_value(value)
