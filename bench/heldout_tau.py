"""Simulated τ of saved drafts on held-out rows, without decoding.

For each draft, a k-chain is drafted (teacher-forced) at every position where decoding could start
one, and its accepted length recorded. Two averages are printed:

- along the decoding walk (``train.objective.decoding_walk``): the steps greedy chain decoding takes,
  each starting right after the previous step's last token. This is what ``val/tau`` reports and, on
  the target's own greedy answers, what ``draftsmith eval`` measures on the same text.
- over every start: a chain from every position. This reads high, because decoding starts fewer
  chains where the draft is strong; validation reported it before the walk landed.

Held-out rows come from an offline EAGLE run's feature cache (``--cache RUN/feature_cache/heldout``;
heads must capture the layers it holds) or from a run's recipe (``--recipe RUN/config.yaml``: the
same held-out split as training, the teacher computed by a target forward; EAGLE and distill drafts, and
DFlash / DSpark drafts of any recipe, walked block by block as DFlash's validation walks them, P-EAGLE heads
a chain per forward as P-EAGLE's validation walks them).

With ``--decode N`` (``--cache`` only), the first N single-turn held-out conversations are also
decoded for real (``decode.speculative.generate`` with the head as drafter and packed CPU kernels, as
``draftsmith eval`` runs it), and the accepted length of each verify step is compared with the
walk's, step by step, up to where the decoded text leaves the data (the data was generated in padded
batches, so a near-tie can go the other way) and while full k-chains are drafted. Prints a table,
writes JSON.

    python bench/heldout_tau.py --cache runs/smollm2_eagle3_cpu_ft/feature_cache/heldout \\
        --draft runs/smollm2_eagle3_cpu/draft runs/smollm2_eagle3_cpu_ft/draft --out /tmp/heldout.json
    python bench/heldout_tau.py --recipe runs/smollm2_distill_cpu/config.yaml \\
        --draft runs/smollm2_distill_cpu/draft runs/smollm2_distill_cpu_undistilled

Heads other pipelines wrote (SpecForge, ModelOpt, speculators) are read as ``draftsmith eval`` reads them
(``drafts/eagle_import.py``), so one judge scores every pipeline's head on the same held-out rows
(``bench/peer_training.py``'s sweep chooses each pipeline's setting by it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

import torch
from benchlib.records import provenance, write_json
from tqdm.auto import tqdm

from draftsmith.decode.cpu_kernels import pack_for_decoding
from draftsmith.decode.target import load_target
from draftsmith.drafts import build_drafter
from draftsmith.drafts.base import (
    DFLASH,
    DISTILL,
    DSPARK,
    EAGLE1,
    EAGLE3,
    PEAGLE,
    PEER_DFLASH,
    kind_of_checkpoint,
)
from draftsmith.eval.report import hardware_description
from draftsmith.eval.stats import AcceptanceStats
from draftsmith.train.config import load_config
from draftsmith.train.corpus.tokens import pad_id_of
from draftsmith.train.feature_dataset import FeatureCache, collate_cached
from draftsmith.train.loop import prepare_datasets
from draftsmith.train.objective import decoding_walk
from draftsmith.train.registry import build_objective


def summary(histogram: list[int], k: int) -> dict:
    stats = AcceptanceStats(Counter({(k, a): n for a, n in enumerate(histogram) if n}))
    return {
        "tau": stats.tau,
        "per_position": stats.per_position,
        "steps": stats.num_steps,
        "histogram": histogram,
    }


def measure(objective, draft, batches, k: int) -> dict:
    walk = torch.zeros(k + 1, dtype=torch.long)
    every = torch.zeros(k + 1, dtype=torch.long)
    for batch, teacher in batches:
        accepted, starts = objective.chain_lengths(draft, batch, teacher, k)
        walk += decoding_walk(accepted, starts, k)
        every += torch.bincount(accepted[starts].cpu(), minlength=k + 1)
    return {"walk": summary(walk.tolist(), k), "every_start": summary(every.tolist(), k)}


def cached_batches(cache: FeatureCache, batch_size: int, pad_id: int):
    """(Batch, Teacher) from an offline feature cache."""
    for lo in tqdm(range(0, len(cache), batch_size), desc="held-out rows", unit="batch", leave=False):
        rows = [cache[i] for i in range(lo, min(lo + batch_size, len(cache)))]
        yield collate_cached(rows, pad_id=pad_id, dtype=torch.float32)


def recipe_batches(heldout, target, objective, batch_size: int, pad_id: int):
    """(Batch, Teacher) of a recipe's held-out rows, the teacher computed by a target forward."""
    from draftsmith.train.corpus.tokens import collate
    from draftsmith.train.teacher import compute_teacher

    for lo in tqdm(range(0, len(heldout), batch_size), desc="held-out rows", unit="batch", leave=False):
        batch = collate([heldout[i] for i in range(lo, min(lo + batch_size, len(heldout)))], pad_id)
        yield batch, compute_teacher(target, batch, objective.capture_layers, objective.teacher_topk)


def objective_for(kind: str, options: dict, path: str, target, scratch: Path | None = None):
    """The objective of a saved draft of ``kind``, built to load it (``build_draft`` returns it). An EAGLE-3
    head another pipeline wrote (SpecForge, ModelOpt, speculators layouts) is read by
    ``drafts/eagle_import.py``, as ``draftsmith eval`` reads it, and saved into ``scratch`` first."""
    if kind in (EAGLE1, EAGLE3):
        return build_objective(kind, target, {"init_from": own_head(path, target, scratch)})
    if kind == DISTILL:
        return build_objective(kind, target, {**options, "init": "pretrained", "path": path})
    raise SystemExit(f"draft kind {kind!r}: this bench measures {EAGLE1}, {EAGLE3} and {DISTILL} drafts")


BLOCK_KINDS = (DFLASH, DSPARK, PEER_DFLASH)
"""Kinds judged by DFlash's own walk (a block per chain start, its first k slots as the chain)."""


def block_objective(kind: str, path: str, target):
    """(objective, draft) for a block draft at ``path`` of ``kind`` (draftsmith's DFlash or DSpark, or a peer's
    DFlash read as ``draftsmith eval`` reads it): the objective built to the draft's own shape (layers, block,
    taps, mask token, vocabulary map), so its ``chain_lengths`` walks the draft exactly as training's validation
    walks draftsmith's own."""
    from draftsmith.drafts.dflash import DFlashDraft, load_draft
    from draftsmith.drafts.dflash_import import import_dflash
    from draftsmith.drafts.dspark import DSparkDraft

    if kind == PEER_DFLASH:
        draft, kind = import_dflash(target, path), DFLASH
    else:
        draft = load_draft(target, path, DSparkDraft if kind == DSPARK else DFlashDraft, f"{kind} draft")
    c = draft.config
    options = {"num_layers": c.num_hidden_layers, "block_size": c.block_size,
               "capture_layer_ids": list(c.capture_layer_ids), "mask_token_id": c.mask_token_id}  # fmt: skip
    if kind == DSPARK:
        options["markov_rank"] = c.markov_rank
    objective = build_objective(kind, target, options)  # the target's vocabulary: no token counts needed
    if draft.has_own_head:  # its head's rows and their target ids are the draft's, not recounted here
        objective.d2t = draft.d2t.cpu()
    return objective, draft.float().eval()


def parallel_objective(path: str, target):
    """(objective, head) for a P-EAGLE head at ``path``: the objective built to the head's own shape (layers, taps,
    parallel depths, mask token), so its ``chain_lengths`` drafts each chain in one forward exactly as training's
    validation does; the head's own vocabulary map scores its tokens (the objective's is never read)."""
    from draftsmith.drafts.eagle import load_head

    head = load_head(target, path, "a P-EAGLE head").float().eval()
    c = head.config
    options = {"num_layers": c.num_decoder_layers, "capture_layer_ids": list(c.capture_layer_ids),
               "parallel_depths": c.parallel_depths, "mask_token_id": c.mask_token_id,
               "draft_vocab_size": c.vocab_size}  # fmt: skip
    return build_objective(PEAGLE, target, options), head


def own_head(path: str, target, scratch: Path | None) -> str:
    """``path`` when draftsmith saved it, else the peer's head imported for ``target`` and saved in ``scratch``."""
    config = (
        json.loads((Path(path) / "config.json").read_text()) if (Path(path) / "config.json").is_file() else {}
    )
    if "preset" in config or scratch is None:
        return path  # draftsmith's own (or not a head at all: init_from says what is missing)
    from draftsmith.drafts.eagle_import import import_head

    folder = Path(scratch) / f"imported-{len(list(Path(scratch).iterdir()))}"
    import_head(target, path).float().save_pretrained(folder)
    return str(folder)


def single_turn_conversations(cache: FeatureCache, count: int, min_answer: int = 32):
    """Up to ``count`` (row, prompt ids, answer ids, the conversation's cached row) of held-out
    conversations whose learnt tokens are one run (a single answer) of at least ``min_answer`` tokens."""
    found = []
    for index in range(len(cache)):
        row = cache[index]
        n = len(row["input_ids"])
        pos = row.get("position_ids")
        bounds = [0, n] if pos is None else (pos == 0).nonzero().flatten().tolist() + [n]
        for lo, hi in zip(bounds, bounds[1:]):
            learnt = row["loss_mask"][lo:hi].bool()
            where = learnt.nonzero().flatten()
            if len(where) < min_answer or not learnt[int(where[0]) : int(where[-1]) + 1].all():
                continue
            part = {
                key: ({i: f[lo:hi] for i, f in value.items()} if isinstance(value, dict) else value[lo:hi])
                for key, value in row.items()
                if value is not None
            }
            ids = part["input_ids"]
            first, last = int(where[0]), int(where[-1])
            found.append((index, ids[:first], ids[first : last + 1], part))
            if len(found) == count:
                return found
    return found


def decode_check(objective, head, drafter, target, cache, k: int, count: int, pad_id: int) -> dict:
    """Real decoding against the walk on ``count`` held-out conversations (see the module docstring)."""
    from draftsmith.decode.speculative import generate
    from draftsmith.train.objective import decoding_walk_steps

    simulated, decoded = [], []
    for _, prompt, answer, part in tqdm(
        single_turn_conversations(cache, count), desc="decode", unit="conv", leave=False
    ):
        batch, teacher = collate_cached([part], pad_id=pad_id, dtype=torch.float32)
        walk = decoding_walk_steps(*objective.chain_lengths(head, batch, teacher, k))[0]
        result = generate(target, prompt, drafter, k=k, max_new_tokens=len(answer))
        same = next(
            (i for i, (a, b) in enumerate(zip(result.tokens, answer.tolist())) if a != b),
            min(len(result.tokens), len(answer)),
        )
        covered = 0
        for sim, dec, asked in zip(walk, result.accepted, result.chosen_k):
            covered += dec + 1
            if asked != k or covered > same:
                break
            simulated.append(sim)
            decoded.append(dec)
    full = [k] * len(simulated)  # only steps that drafted a full k-chain are compared
    return {
        "steps_compared": len(simulated),
        "steps_equal": sum(a == b for a, b in zip(simulated, decoded)),
        "tau_simulated": AcceptanceStats.from_lists(simulated, full).tau,
        "tau_decoded": AcceptanceStats.from_lists(decoded, full).tau,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--target", default=None, help="default: the recipe's, or smollm2-135m-instruct with --cache"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--cache", help="an EAGLE run's held-out feature cache (RUN/feature_cache/heldout)")
    source.add_argument(
        "--recipe",
        help="a run's resolved config (RUN/config.yaml): its held-out split, the teacher computed online; "
        "for EAGLE and distill drafts, and any DFlash or DSpark draft (draftsmith's or a peer's)",
    )
    parser.add_argument("--draft", required=True, nargs="+", help="saved draft folders (RUN/draft)")
    parser.add_argument("--k", type=int, default=5, help="chain length (default: 5)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument(
        "--decode",
        type=int,
        default=0,
        metavar="N",
        help="also decode N held-out conversations for real and compare with the walk (default: 0)",
    )
    parser.add_argument("--out", default=None, help="JSON report")
    args = parser.parse_args(argv)
    if args.k < 1:
        parser.error(f"--k must be at least 1, got {args.k}")

    started = provenance()  # the code as it was when the judging began
    torch.set_grad_enabled(False)
    if args.recipe:
        if args.decode:
            parser.error("--decode needs --cache (the held-out answers of an offline EAGLE run)")
        recipe = load_config(args.recipe)
        target = load_target(args.target or recipe.target.spec, "cpu", "float32")
        _, heldout = prepare_datasets(recipe, target.tokenizer)
        kind, options, source, rows = recipe.draft.kind, recipe.draft.options, args.recipe, len(heldout)
    else:
        target = load_target(args.target or "smollm2-135m-instruct", "cpu", "float32")
        cache = FeatureCache(args.cache)
        source, rows = args.cache, len(cache)
    pad_id = pad_id_of(target.tokenizer)
    results = {}
    scratch = tempfile.TemporaryDirectory(prefix="heldout-tau-")
    for path in args.draft:
        head_kind = kind_of_checkpoint(path).name if (Path(path) / "config.json").is_file() else None
        if head_kind in BLOCK_KINDS:  # judged by its own kind, whatever the recipe trained
            objective, draft = block_objective(head_kind, path, target)
        elif head_kind == PEAGLE:
            objective, draft = parallel_objective(path, target)
        else:
            if not args.recipe:
                kind = json.loads((Path(path) / "config.json").read_text()).get("preset", EAGLE3)
                options = {}
            objective = objective_for(kind, options, path, target, Path(scratch.name))
            draft = objective.build_draft().eval()
        if args.recipe:
            batches = recipe_batches(heldout, target, objective, args.batch_size, pad_id)
        else:
            missing = sorted(set(objective.capture_layers) - set(cache.layers))
            if missing:
                raise SystemExit(
                    f"{path} reads target layers {list(objective.capture_layers)} but {args.cache} holds "
                    f"{cache.layers} (missing {missing}); use a cache built for this head's layers"
                )
            batches = cached_batches(cache, args.batch_size, pad_id)
        results[path] = measure(objective, draft, batches, args.k)
        if args.decode:
            drafter = build_drafter(path, target)
            pack_for_decoding(target.model, drafter)  # as `draftsmith eval` runs by default
            results[path]["decode_check"] = decode_check(
                objective, draft, drafter, target, cache, args.k, args.decode, pad_id
            )

    print(f"\nheld-out rows: {rows} of {source}; k = {args.k}")
    print("| draft | τ along the walk | per-position acceptance (walk) | steps | τ over every start |")
    print("|---|---:|---|---:|---:|")
    for path, r in results.items():
        walk, every = r["walk"], r["every_start"]
        positions = " ".join(f"{p:.2f}" for p in walk["per_position"])
        print(f"| {path} | {walk['tau']:.2f} | {positions} | {walk['steps']} | {every['tau']:.2f} |")
    for path, r in results.items():
        if "decode_check" in r:
            c = r["decode_check"]
            print(
                f"{path}: real decoding took {c['steps_equal']} of {c['steps_compared']} compared steps "
                f"exactly as the walk (τ {c['tau_decoded']:.2f} decoded, {c['tau_simulated']:.2f} simulated)"
            )
    if args.out:
        report = {
            "held_out": source,
            "rows": rows,
            "k": args.k,
            "target": target.name,
            "hardware": hardware_description(torch.device("cpu"), torch.float32),
            "drafts": results,
            "provenance": started,
        }
        write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
