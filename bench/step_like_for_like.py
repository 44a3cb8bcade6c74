"""One like-for-like EAGLE-3 training-step figure for every pipeline, measured in one run (issue 35).

The old "draftsmith's offline step is 2.0x SpecForge's" compared two runs (budgets, caches, tokens a step)
and two kinds of step: draftsmith's read cached top-64 logits, SpecForge's computes the target's LM head
(49,152 x 576) from the cached final state. Here every pipeline trains, one after another under the bench
lock, on the same conversations of one capture, each step doing the same work. The choices:

- Capture: bench/peer_training.py's bf16 one (``--stages data capture``: the target run by transformers
  in draftsmith's own dtype, bf16 on a CPU with fast bf16; aux layers 1, 14, 26 and the final state),
  read-only. The first ``--conversations`` training conversations (in the capture's order: the rows
  draftsmith's sampler takes first) and ``--heldout`` held-out ones are linked into ``--work`` in
  SpecForge's and speculators' layouts and written, from the very same tensors, in ModelOpt's offline
  ``.pt`` layout and as a draftsmith feature cache (``subset_work``).
- Work a step: "both computing the target head". Every step applies the target's LM head to the cached
  final state: SpecForge's ``TargetHead`` (LM head on the post-norm state it reads), speculators'
  ``verifier_norm`` + ``lm_head`` (pre-norm state), ModelOpt's offline mode (``eagle_offline``: LM head on
  the post-norm state, its self-distillation targets), draftsmith's ``cache.teacher: final_state``
  (final norm + LM head, then its top-64). SpecForge and ModelOpt read the post-norm state, speculators
  and draftsmith the pre-norm one and apply the norm (576 values a token: nothing beside the head).
- Tokens a step: ``--step-tokens`` (2,048) real tokens where each pipeline's own settings allow it:
  draftsmith 4 rows of up to 512 (its recipe's ``max_length``; the conversations packed in order),
  speculators ``total-seq-len`` 2,048 (its packing), SpecForge ``training.batch_size`` and ModelOpt
  ``training.per_device_train_batch_size`` = step tokens / the mean conversation (neither packs:
  SpecForge pads a batch to its longest conversation, ModelOpt every row to ``training_seq_len`` 512).
  Each run's drivers count the real tokens and the positions computed (padding included) of every step.
- Precision: each pipeline's bf16 mixed precision (bf16 matmuls, float32 master weights): draftsmith's
  ``trainer.precision`` auto = bf16-mixed where bf16 is fast (read back from the run), SpecForge's FSDP
  ``param_dtype`` bfloat16, speculators' autocast to its ``hidden_states_dtype`` bfloat16, ModelOpt's
  recipe ``bf16: true``. The features are bf16 for all.
- Everything else is each pipeline's own (optimizer, lr, schedule, TTT depth 3, draft vocabulary 8,192,
  one decoder layer: the bench's shape), as bench/peers/*_run.py say.
- Rate: the STEADY rate only, from the optimizer-step marks each driver records
  (``peerbench.training.throughput``: from the end of step 2 to the end of the last; step 1 with fewer than 8
  steps), tokens counted per step; also the median seconds a step (robust to a checkpoint or an
  evaluation falling between two marks). No whole-run rate is given: start-up, loading and the final
  evaluation are not steps.

``--online`` adds a second, separately labelled table: ModelOpt online against draftsmith online (the
whole target run in every step by both), ModelOpt on the same conversations padded to 512 as above,
draftsmith on the first rows of its own packed data (the rows these conversations were split from, as
many steps as the packed subset makes).

Checked on the real target: ModelOpt's offline steps on the written ``.pt`` files give the losses of its
online steps on the same batches (24.89, 24.67, 24.76 in the smoke run), and draftsmith's head in the step
(``train/teacher.head_logits``) on the target's own last layer gives its forward's logits exactly.

What a run costs on the 2-core CPU it was written on, at the defaults (160 conversations, 37,076
positions, ~18 steps of ~2,048 tokens): a smoke run at nice 19 beside another job's training took per
step draftsmith 6 s, speculators 8, ModelOpt 14, SpecForge 21 (online: draftsmith 11, ModelOpt 21) and
25-100 s to start each pipeline, so about 30 min for both groups there; with the CPU to itself, expect
roughly half (offline group ~10 min, ``--online`` ~8 min more).

    python bench/step_like_for_like.py --capture runs/sweep_400k --work runs/like4like \\
        --out bench/results/step_like_for_like.json
    python bench/step_like_for_like.py --capture runs/sweep_400k --work runs/like4like_smoke \\
        --conversations 40 --online --lock /tmp/smoke.lock --out runs/like4like_smoke.json  # smoke: no figure
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from peerbench import common
from peerbench.common import cpu_name, peer_python, pipeline_of, quickstart_seed, run_timed
from peerbench.data import read_jsonl, read_vocab_counts, write_jsonl
from peerbench.training import throughput, train_command
from safetensors import safe_open
from safetensors.torch import save_file

OFFLINE = ("draftsmith", "specforge", "speculators", "modelopt")
ONLINE = ("draftsmith", "modelopt")
WORK_A_STEP = {
    "draftsmith": "reads aux + pre-norm final state (bf16); final norm + LM head + top-64 in the step",
    "specforge": "reads aux + post-norm final state (bf16); TargetHead: LM head + softmax in the step",
    "speculators": "reads aux + pre-norm final state (bf16); verifier_norm + lm_head in the step",
    "modelopt": "reads aux + post-norm final state (bf16); LM head in the step (eagle_offline)",
    "draftsmith-online": "the whole target (bf16) in the step: features + top-64 logits",
    "modelopt-online": "the whole target (bf16) in the step: features + logits",
}
PRECISION = {
    "draftsmith": "bf16-mixed (auto)",
    "specforge": "bf16 (FSDP param_dtype)",
    "speculators": "bf16 autocast",
    "modelopt": "bf16 (recipe bf16: true)",
}


# --------------------------------------------------------------------------- pure parts


def pack(lengths: list[int], max_length: int) -> list[list[int]]:
    """Consecutive conversations (by length) packed greedily into rows of at most ``max_length`` positions:
    a list of rows, each the indices of its conversations, in order."""
    rows: list[list[int]] = []
    used = max_length
    for i, n in enumerate(lengths):
        if n > max_length:
            raise ValueError(f"conversation {i} has {n} positions, more than a row's {max_length}")
        if used + n > max_length:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def step_settings(step_tokens: int, mean_length: float, max_length: int) -> dict[str, list[str]]:
    """Each pipeline's own settings for ``step_tokens`` real tokens a step, in its own words (module docstring)."""
    rows = max(1, step_tokens // max_length)
    conversations = max(1, round(step_tokens / mean_length))
    return {
        "draftsmith": [f"trainer.batch_size={rows}"],
        "specforge": [f"training.batch_size={conversations}"],
        "speculators": [f"total-seq-len={step_tokens}"],
        "modelopt": [f"training.per_device_train_batch_size={conversations}"],
    }


def steady(run: dict, budget: dict) -> dict:
    """The steady figures of one run's record: ``peerbench.training.throughput``'s steady tokens/s and s/step,
    the median s/step and the mean real tokens and positions of the same steps."""
    marks = run.get("step_marks") or []
    rates = {k: v for k, v in throughput({**run, "wall_s": 1.0, "cpu_s": 0}, budget).items()
             if k.startswith("steady_")}  # fmt: skip
    if not rates:
        return {"steps": len(marks)}
    skip = 2 if len(marks) >= 8 else 1
    gaps = [b[0] - a[0] for a, b in zip(marks[skip:], marks[skip + 1 :])]
    out = {"steps": len(marks), "skipped": skip + 1, "median_s_per_step": statistics.median(gaps), **rates}
    for key in ("step_tokens", "step_positions"):
        counted = run.get(key) or []
        if len(counted) == len(marks):
            out[f"{key.removeprefix('step_')}_per_step"] = statistics.fmean(counted[skip + 1 :])
    return out


# --------------------------------------------------------------------------- the inputs


def subset_work(capture: Path, work: Path, conversations: int, heldout: int) -> dict:
    """``work`` made from the first conversations of ``capture`` in every pipeline's offline layout (module
    docstring); returns its budget (the capture's, with the subset's counts)."""
    from benchlib import peer_inputs

    budget = json.loads((capture / "data" / "budget.json").read_text())
    capture_train = read_jsonl(capture / "data" / "train.jsonl")
    train = capture_train[:conversations]
    held = read_jsonl(capture / "data" / "heldout.jsonl")[:heldout]
    if len(train) < conversations:
        raise SystemExit(f"{capture} holds {len(train)} training conversations, fewer than {conversations}")
    marker = work / "subset.json"
    if work.exists() and any(work.iterdir()) and not marker.exists():
        raise SystemExit(f"{work} holds files this bench did not write; give --work an empty or new folder")
    if work.exists():
        shutil.rmtree(work)  # a fresh subset: every input below is derived from the capture, nothing is kept
    data = work / "data"
    data.mkdir(parents=True)
    marker.write_text(
        json.dumps({"capture": str(capture), "conversations": conversations, "heldout": heldout})
    )
    write_jsonl(data / "train.jsonl", train)
    write_jsonl(data / "heldout.jsonl", held)
    shutil.copy(capture / "data" / "vocab_counts.json", data / "vocab_counts.json")
    rows = pack([len(c["input_ids"]) for c in train], budget["max_length"])
    budget.update(train=peer_inputs.token_counts(train), heldout=peer_inputs.token_counts(held),
                  capture=str(capture), draftsmith_steps=-(-len(rows) // budget["batch_size"]))  # fmt: skip
    (data / "budget.json").write_text(json.dumps(budget, indent=1))
    for split, count in (("train", len(train)), ("heldout", len(held))):
        (work / "specforge" / split).mkdir(parents=True)
        for i in range(count):
            name = f"data_{i:06d}.ckpt"
            (work / "specforge" / split / name).symlink_to((capture / "specforge" / split / name).resolve())
    states = work / "speculators" / "hidden_states"
    states.mkdir(parents=True)
    sources = [*range(len(train)), *(len(capture_train) + j for j in range(len(held)))]
    for i, source in enumerate(sources):  # its files are numbered training first, then held-out
        (states / f"hs_{i}.safetensors").symlink_to((capture / "speculators" / "hidden_states" /
                                                      f"hs_{source}.safetensors").resolve())  # fmt: skip
    counts = read_vocab_counts(capture)["assistant"]
    peer_inputs.write_speculators_index(work / "speculators", train, held, counts)
    write_modelopt_offline(work / "specforge", work / "modelopt")
    write_draftsmith_cache(work / "speculators", train, held, work / "draftsmith_cache", budget)
    return budget


def write_modelopt_offline(specforge: Path, out: Path) -> None:
    """ModelOpt's offline ``.pt`` files (its ``OfflineSupervisedDataset`` keys) from SpecForge's records: the
    same tensors, the final state after the norm as both read it."""
    for split in ("train", "heldout"):
        (out / split).mkdir(parents=True)
        for path in sorted((specforge / split).glob("*.ckpt")):
            record = torch.load(path, weights_only=True)
            torch.save({"input_ids": record["input_ids"], "loss_mask": record["loss_mask"],
                        "hidden_states": record["hidden_state"][0], "aux_hidden_states": record["aux_hidden_state"][0]},
                       out / split / f"{path.stem}.pt")  # fmt: skip


def write_draftsmith_cache(speculators: Path, train: list[dict], heldout: list[dict], out: Path, budget: dict,
                           examples_per_shard: int = 256) -> None:  # fmt: skip
    """A draftsmith ``final_state`` feature cache (``train/feature_cache.py``'s layout) in ``out/{train,heldout}``
    from speculators' hidden states (the three captured layers and the last layer before the norm, bf16),
    the conversations packed in order into rows of up to ``budget["max_length"]``."""
    from draftsmith.drafts.eagle import default_eagle3_layers
    from draftsmith.train.feature_cache import FORMAT_VERSION, MANIFEST, shard_path

    target = json.loads((Path(budget["target_path"]) / "config.json").read_text())
    final = target["num_hidden_layers"] - 1
    layers = budget.get("capture_layers") or default_eagle3_layers(target["num_hidden_layers"])
    names = [*layers, final]  # the order of speculators' stacked states
    for split, convs, offset in (("train", train, 0), ("heldout", heldout, len(train))):
        folder = out / split
        folder.mkdir(parents=True)
        rows = pack([len(c["input_ids"]) for c in convs], budget["max_length"])
        for shard, start in enumerate(range(0, len(rows), examples_per_shard)):
            members = rows[start : start + examples_per_shard]
            parts = [[] for _ in names]
            for row in members:
                for i in row:
                    with safe_open(
                        str(speculators / "hidden_states" / f"hs_{offset + i}.safetensors"), "pt"
                    ) as f:
                        if f.get_tensor("token_ids").tolist() != convs[i]["input_ids"]:
                            raise ValueError(
                                f"hs_{offset + i}.safetensors holds other tokens than conversation {i}"
                            )
                        states = f.get_tensor("hidden_states")
                    for n in range(len(names)):
                        parts[n].append(states[:, n])
            lengths = [sum(len(convs[i]["input_ids"]) for i in row) for row in members]
            flat = [c for row in members for c in (convs[i] for i in row)]
            tensors = {
                "offsets": torch.tensor([0, *lengths]).cumsum(0),
                "input_ids": torch.tensor([t for c in flat for t in c["input_ids"]], dtype=torch.int32),
                "loss_mask": torch.tensor([m for c in flat for m in c["loss_mask"]], dtype=torch.uint8),
                "position_ids": torch.tensor([p for c in flat for p in range(len(c["input_ids"]))], dtype=torch.int32),
                **{f"features.{layer}": torch.cat(parts[n]).to(torch.bfloat16).contiguous()
                   for n, layer in enumerate(names)},
            }  # fmt: skip
            save_file(tensors, str(shard_path(folder, shard)), metadata={"num_examples": str(len(members))})
        manifest = {"format_version": FORMAT_VERSION, "target": {"path": budget["target_path"]},
                    "target_dtype": "bfloat16", "feature_dtype": "bfloat16", "layers": sorted(set(names)), "topk": 64,
                    "full_logits": False, "teacher": "final_state", "final_layer": final,
                    "examples_per_shard": examples_per_shard, "num_examples": len(rows),
                    "written_from": str(speculators)}  # fmt: skip
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


# --------------------------------------------------------------------------- the runs


def run_pipeline(run: str, work: Path, budget: dict, overrides: list[str], offline: bool) -> dict:
    """One pipeline's driver under the bench lock (``peerbench.common.run_timed``); its record with the steady
    figures."""
    pipeline = pipeline_of(run)
    if pipeline != "draftsmith" and not peer_python(pipeline).exists():
        return {"skipped": f"no venv for {pipeline}: bash scripts/install_peers.sh --train {pipeline}"}
    cmd = train_command(run, work, budget, overrides)
    if offline and pipeline in ("draftsmith", "modelopt"):  # SpecForge and speculators read work/ as is
        cmd += ["--offline", str(work / ("draftsmith_cache" if pipeline == "draftsmith" else "modelopt"))]
    out = work / "runs" / run
    print(f"step_like_for_like: training {run} ...", file=sys.stderr, flush=True)
    record = run_timed(cmd, out.with_suffix(".log"), dict(os.environ, PYTHONUNBUFFERED="1"))
    result = out / "result.json"
    record.update(
        json.loads(result.read_text()) if result.exists() else {"error": "no result.json; see the log"}
    )
    record.update(overrides=overrides, steady=steady(record, budget), does=WORK_A_STEP[run])
    record["precision"] = (record.get("heldout") or {}).get("precision") or PRECISION[pipeline]
    print(f"step_like_for_like: {run} rc={record['returncode']}", file=sys.stderr, flush=True)
    return record


def print_table(title: str, runs: dict) -> None:
    print(
        f"\n{title}\nSTEADY rate only (between optimizer-step marks, the first steps skipped; no whole-run rate)"
    )
    print(f"{'run':<18} {'rc':>3} {'steps':>5} {'tok/step':>8} {'pos/step':>8} {'s/step':>7} {'median':>7} "
          f"{'tok/s':>7}  {'precision':<32} each step")  # fmt: skip
    for run, r in runs.items():
        if "skipped" in r:
            print(f"{run:<18} skipped: {r['skipped']}")
            continue
        s = r["steady"]

        def num(key, digits=0, s=s):
            value = s.get(key)
            return "-" if value is None else f"{value:.{digits}f}"

        print(f"{run:<18} {r['returncode']:>3} {s['steps']:>5} {num('tokens_per_step'):>8} {num('positions_per_step'):>8} "
              f"{num('steady_s_per_step', 2):>7} {num('median_s_per_step', 2):>7} {num('steady_tokens_per_wall_s'):>7}  "
              f"{r['precision']:<32} {r['does']}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--capture", type=Path, required=True,
                   help="a bench/peer_training.py work folder holding data/, specforge/, speculators/ (read only)")  # fmt: skip
    p.add_argument(
        "--work", type=Path, default=Path("runs/step_like_for_like"), help="the subset, logs, heads"
    )
    p.add_argument("--conversations", type=int, default=160, help="training conversations (one pass each)")
    p.add_argument(
        "--heldout", type=int, default=8, help="held-out conversations (each pipeline's end-of-run check)"
    )
    p.add_argument(
        "--step-tokens", type=int, default=2048, help="real tokens a step, where a pipeline allows it"
    )
    p.add_argument("--runs", nargs="*", default=list(OFFLINE), choices=OFFLINE, help="the offline group")
    p.add_argument(
        "--online", action="store_true", help="also ModelOpt and draftsmith online (a second table)"
    )
    p.add_argument("--lock", type=Path, default=common.LOCK,
                   help="the bench lock file (another only for a smoke run beside a measurement)")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench/results/step_like_for_like.json"))
    args = p.parse_args(argv)
    common.LOCK = args.lock
    from benchlib.records import provenance

    work = args.work.resolve()
    start = time.perf_counter()
    budget = subset_work(args.capture.resolve(), work, args.conversations, args.heldout)
    mean_length = budget["train"]["positions"] / budget["train"]["conversations"]
    settings = step_settings(args.step_tokens, mean_length, budget["max_length"])
    record = {"provenance": provenance(seed=quickstart_seed()), "cpu": cpu_name(),
              "capture": str(args.capture.resolve()), "lock": str(args.lock), "step_tokens": args.step_tokens,
              "budget": budget, "inputs_s": time.perf_counter() - start, "offline": {}, "online": {},
              "rate": "steady only: peerbench.training.throughput between optimizer-step marks, the first steps "
                      "skipped (steady.skipped); no whole-run rate"}  # fmt: skip

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1, default=str))

    for run in args.runs:
        record["offline"][run] = run_pipeline(run, work, budget, settings[run], offline=True)
        save()
    for pipeline in ONLINE if args.online else ():
        record["online"][f"{pipeline}-online"] = run_pipeline(f"{pipeline}-online", work, budget,
                                                              settings[pipeline], offline=False)  # fmt: skip
        save()
    counts = budget["train"]
    print(f"\n{counts['conversations']} conversations, {counts['positions']} positions ({counts['loss_tokens']} in "
          f"the loss) from the bf16 capture {record['capture']}; {args.step_tokens} real tokens a step asked")  # fmt: skip
    print_table(
        "Offline, each step computing the target head from the cached final state:", record["offline"]
    )
    if record["online"]:
        print_table("Online, the whole target run in every step (a separate comparison):", record["online"])
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
