"""The data stage (draftsmith's training rows as each peer's conversations, the token budget, vocabulary counts)
and the capture stage (the stand-in for SGLang's / vLLM's hidden-state capture, in SpecForge's and speculators'
layouts)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .common import QUICKSTART_DATA, TARGET, bench_lock

# --------------------------------------------------------------------------- stage: data


def render_rows(seed: int = 0):
    """(tokenizer, quickstart recipe, train rows, held-out rows) exactly as ``draftsmith train quickstart`` builds them."""
    from transformers import AutoTokenizer

    from draftsmith.loading import resolve_model_path
    from draftsmith.train.config import load_config
    from draftsmith.train.loop import prepare_datasets

    config = load_config("quickstart")
    if list(config.data.paths) != list(QUICKSTART_DATA):
        raise SystemExit(f"the quickstart recipe's data changed to {config.data.paths}; update this bench")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(TARGET)[0])
    train_ds, heldout_ds = prepare_datasets(config, tokenizer)
    return tokenizer, config, train_ds, heldout_ds


def stage_data(work: Path, tokens: int, draft: str = "eagle3") -> dict:
    from benchlib import peer_inputs as peer

    from draftsmith.loading import resolve_model_path

    tokenizer, config, train_ds, heldout_ds = render_rows()
    t = config.trainer
    lengths = [len(ids) for ids in train_ds["input_ids"]]
    # how many rows to look at: enough for the budget even with short rows
    order = peer.sampler_order(len(train_ds), t.batch_size, t.seed, max(len(train_ds), -(-tokens // 64)))
    steps = peer.steps_for_budget([lengths[i] for i in order], tokens, t.batch_size)
    rows = [train_ds[i] for i in order[: steps * t.batch_size]]
    train = [c for row in rows for c in peer.conversations_of(row)]
    heldout = [c for row in heldout_ds for c in peer.conversations_of(row)]
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    write_jsonl(data / "train.jsonl", train)
    write_jsonl(data / "heldout.jsonl", heldout)
    (data / "vocab_counts.json").write_text(json.dumps(vocab_counts(train_ds)))
    record = {
        "target_path": resolve_model_path(TARGET)[0],
        "tokens_asked": tokens,
        "draftsmith_steps": steps,
        "train_rows_available": len(train_ds),
        "passes": steps * t.batch_size / len(train_ds),
        "batch_size": t.batch_size,
        "max_length": config.data.max_length,
        "train": peer.token_counts(train),
        "heldout": peer.token_counts(heldout),
        "draft_vocab_size": config.draft.options["draft_vocab_size"],
        "ttt_steps": config.draft.options["ttt_steps"],
        "num_layers": config.draft.options["num_layers"],
        "draft": draft,
    }
    if draft == "dflash":  # one layer, no draft vocabulary (every peer's DFlash scores the target's)
        from transformers import AutoConfig

        from draftsmith.drafts.dflash import default_tap_layers

        taps = default_tap_layers(AutoConfig.from_pretrained(record["target_path"]).num_hidden_layers)
        record.update(peer.DFLASH_SHAPE, draft_vocab_size=None, ttt_steps=None, capture_layers=taps)
    (data / "budget.json").write_text(json.dumps(record, indent=1))
    return record


def vocab_counts(train_ds) -> dict[str, dict[int, int]]:
    """Token counts over all training rows (not only the budget's), for each run's own vocabulary rule.

    draftsmith picks its draft vocabulary from the whole training set; so does ModelOpt's calibration
    script (over every token) and speculators' / SpecForge's counts (over assistant tokens), each given
    the whole set here. A small budget alone holds too few distinct tokens for an 8,192-token vocabulary.
    """
    every: dict[int, int] = {}
    assistant: dict[int, int] = {}
    for ids, mask in zip(train_ds["input_ids"], train_ds["loss_mask"]):
        for t, m in zip(ids, mask):
            every[t] = every.get(t, 0) + 1
            if m:
                assistant[t] = assistant.get(t, 0) + 1
    return {"all": every, "assistant": assistant}


def read_vocab_counts(work: Path) -> dict[str, dict[int, int]]:
    raw = json.loads((work / "data" / "vocab_counts.json").read_text())
    return {kind: {int(t): n for t, n in counts.items()} for kind, counts in raw.items()}


def write_jsonl(path: Path, convs: list[dict]) -> None:
    with open(path, "w") as f:
        for c in convs:
            f.write(json.dumps({"input_ids": c["input_ids"], "loss_mask": c["loss_mask"]}) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


# --------------------------------------------------------------------------- stage: capture


def stage_capture(work: Path) -> dict:
    """The stand-in capture: SpecForge's ``.ckpt`` files (train/, heldout/) and speculators' dataset."""
    import resource

    from benchlib.peer_inputs import capture, write_peer_features
    from transformers import AutoModelForCausalLM

    from draftsmith import files
    from draftsmith.drafts.eagle import default_eagle3_layers
    from draftsmith.loading import resolve_dtype

    with bench_lock() as waited:
        start, cpu0 = time.perf_counter(), _self_cpu()
        budget = json.loads((work / "data" / "budget.json").read_text())
        # the target in the dtype draftsmith's recipe runs it in (``target.dtype: auto``: bf16 where bf16
        # matmuls are fast), so every pipeline trains on the features draftsmith's own teacher computes
        dtype = resolve_dtype("auto", "cpu")
        model = AutoModelForCausalLM.from_pretrained(budget["target_path"], dtype=dtype).eval()
        # the layers every run reads: EAGLE-3's 1, L/2-1, L-4, as draftsmith and all three peers default;
        # DFlash: draftsmith's default taps (the data stage's; the same layers on this target)
        draft = budget.get("draft", "eagle3")
        layers = budget.get("capture_layers") or default_eagle3_layers(model.config.num_hidden_layers)
        train = read_jsonl(work / "data" / "train.jsonl")
        heldout = read_jsonl(work / "data" / "heldout.jsonl")
        # what a capture stopped part way must match to go on from its files (else it starts over)
        stamp = {"target": budget["target_path"], "dtype": str(dtype), "layers": layers,
                 "data": [files.file_digest(work / "data" / name) for name in ("train.jsonl", "heldout.jsonl")]}  # fmt: skip
        positions, here = write_peer_features(
            train, heldout, lambda ids: capture(model, ids, layers), work / "specforge", work / "speculators",
            read_vocab_counts(work)["assistant"], draft, stamp,
        )  # fmt: skip
        wall, cpu = time.perf_counter() - start, _self_cpu() - cpu0
    return {
        "layers": layers,
        "dtype": str(dtype).removeprefix("torch."),
        "positions": positions,
        "captured_here": here,  # fewer than positions where an earlier capture stopped part way
        "wall_s": wall,
        "cpu_s": cpu,
        "tokens_per_s": here / wall,
        "lock_wait_s": waited,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _self_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
