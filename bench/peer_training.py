"""EAGLE-3 (or, --draft dflash, DFlash) training side by side: the peers and draftsmith on the same work.

Every run trains one decoder layer for the bundled SmolLM2-135M-Instruct with the same draft
vocabulary size and TTT depth (DFlash: block size 8, target layers 1, 14, 26), on the same tokens and
loss masks, for the same number of tokens; each peer keeps its own defaults otherwise (lr, optimizer,
schedule, batching). DFlash is trained by SpecForge, speculators and draftsmith (ModelOpt 0.47's
``plugins/hf_dflash.py`` trains online only and has no driver here yet). Stages (--stages):

  data     render draftsmith's builtin training data once with ``draftsmith.train.corpus`` (chat
           template, assistant loss mask, packed rows, the quickstart's held-out rows), take the rows
           draftsmith's sampler trains on first until --tokens, split them back into conversations and
           write those in each peer's input layout (the peers pad or pack conversations themselves;
           train/peer_inputs.py)
  capture  the stand-in for SGLang's / vLLM's hidden-state capture, which do not run here: the target
           run by transformers, in the dtype draftsmith's recipe runs it in (``target.dtype: auto``), over
           every conversation, written as SpecForge's ``.ckpt`` files and
           speculators' ``hs_{i}.safetensors`` (timed apart: it is not part of either peer's training)
  train    each peer in its own venv (bench/peers/*.py, which say where they depart from the peer's
           own pipeline), then ``draftsmith train quickstart``, one at a time under the machine-wide
           bench lock; wall and CPU seconds, peak RSS, per-step timestamps, held-out metrics, the head
  judge    (EAGLE-3) each head's τ on the quickstart's held-out rows by ``bench/heldout_tau.py``, right after
           it trains: the one judge a sweep chooses each pipeline's setting by (never dev)
  eval     one ``draftsmith eval`` run per k (5, auto) over every head (peer heads are read by
           drafts/eagle_import.py), greedy, dev prompts in round-robin order

Prints a table, writes JSON (--out). What it costs on the 2-core CPU it was written on: at
--tokens 16384 about 3-6 min of training per peer; the peers' steps are the slow part, see
BENCHMARKS.md for the measured rates.

    python bench/peer_training.py --tokens 16384 --out bench/results/peer_training_16k.json
    python bench/peer_training.py --tokens 409600 --work runs/peer_training_400k \
        --out bench/results/peer_training_400k.json
    python bench/peer_training.py --draft dflash --runs specforge speculators --tokens 409600 \
        --work runs/peer_dflash_400k --out bench/results/peer_dflash_400k.json

A sweep (issue "Honest numbers": every pipeline tuned at the budget as draftsmith's recipe was) is a list of
``--setting PIPELINE-NAME:...`` runs in each pipeline's own words, chosen afterwards on the held-out split.
Each finished run is saved into --out at once and kept on the next invocation, so a sweep stopped half way
goes on where it stopped:

    python bench/peer_training.py --tokens 409600 --work runs/sweep --stages train --runs \
        --setting specforge-lr3e4:training.learning_rate=3e-4 \
        --setting specforge-lr1e3b4:training.learning_rate=1e-3,training.batch_size=4 \
        --setting speculators-adamw:optimizer=adamw,lr=3e-4,total-seq-len=2048 \
        --setting modelopt-wu50:training.warmup_steps=50 --out bench/results/peer_sweep_400k.json
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PEER_ROOT = Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith")) / "peers"
PEERS = ("modelopt", "specforge", "speculators")
RUNS = (*PEERS, "draftsmith")
LOCK = Path("/tmp/draftsmith-bench.lock")
TARGET = "smollm2-135m-instruct"
STAGES = ("data", "capture", "train", "judge", "eval", "llamacpp")
JUDGE_K = 5
QUICKSTART_DATA = ("builtin:sharegpt_1000", "builtin:gsm8k_train", "builtin:gpteacher_codegen")


# --------------------------------------------------------------------------- stage: data


def quickstart_seed() -> int:
    """The seed every pipeline's rows and draftsmith's run are drawn with: the quickstart recipe's."""
    from draftsmith.train.config import load_config

    return load_config("quickstart").trainer.seed


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
    from draftsmith.loading import resolve_model_path
    from draftsmith.train import peer_inputs as peer

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

    from transformers import AutoModelForCausalLM

    from draftsmith.drafts.eagle import default_eagle3_layers
    from draftsmith.loading import resolve_dtype
    from draftsmith.train.peer_inputs import capture, write_peer_features

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
        positions = write_peer_features(
            train, heldout, lambda ids: capture(model, ids, layers), work / "specforge", work / "speculators",
            read_vocab_counts(work)["assistant"], draft,
        )  # fmt: skip
        wall, cpu = time.perf_counter() - start, _self_cpu() - cpu0
    return {
        "layers": layers,
        "dtype": str(dtype).removeprefix("torch."),
        "positions": positions,
        "wall_s": wall,
        "cpu_s": cpu,
        "tokens_per_s": positions / wall,
        "lock_wait_s": waited,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _self_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# --------------------------------------------------------------------------- stage: train


class bench_lock:
    """The machine-wide benchmark lock (the file ``flock /tmp/draftsmith-bench.lock`` takes); yields the seconds waited."""

    def __enter__(self) -> float:
        self.file = open(LOCK, "a")
        start = time.perf_counter()
        fcntl.flock(self.file, fcntl.LOCK_EX)
        return time.perf_counter() - start

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def run_timed(cmd: list[str], log: Path, env: dict | None = None) -> dict:
    """Run ``cmd`` alone under the bench lock: wall seconds, CPU seconds and peak RSS of it and its children."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with bench_lock() as waited, open(log, "w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
    return {
        "command": cmd,
        "returncode": proc.returncode,
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "lock_wait_s": waited,
        "log": str(log),
    }


def peer_python(peer: str) -> Path:
    return PEER_ROOT / peer / "bin" / "python"


def parse_setting(text: str) -> tuple[str, list[str]]:
    """``PIPELINE-NAME:KEY=VALUE[,KEY=VALUE]`` → (run ``PIPELINE-NAME``, the overrides in the pipeline's own
    words: draftsmith's and ModelOpt's recipe keys, SpecForge's config keys, speculators' flags)."""
    name, sep, items = text.partition(":")
    overrides = [item.strip() for item in items.split(",") if item.strip()]
    pipeline, dash, label = name.partition("-")
    if (
        not sep
        or pipeline not in RUNS
        or not dash
        or not label
        or not overrides
        or any("=" not in item for item in overrides)
    ):
        raise ValueError(f"--setting {text!r}: expected PIPELINE-NAME:KEY=VALUE[,KEY=VALUE] with PIPELINE one of "
                         f"{', '.join(RUNS)} (e.g. specforge-lr3e4:training.learning_rate=3e-4)")  # fmt: skip
    return name, overrides


def parse_ablation(text: str) -> tuple[str, list[str]]:
    """``NAME:KEY=VALUE[,KEY=VALUE]`` → (run ``draftsmith-NAME``, the overrides): ``--setting draftsmith-NAME:...``."""
    try:
        return parse_setting(f"draftsmith-{text}")
    except ValueError:
        raise ValueError(
            f"--ablation {text!r}: expected NAME:KEY=VALUE[,KEY=VALUE] (e.g. lr:optim.lr=1e-4)"
        ) from None


def pipeline_of(run: str) -> str:
    """The pipeline a run name belongs to: ``specforge-lr3e4`` → ``specforge``."""
    return run.partition("-")[0]


def train_command(run: str, work: Path, budget: dict, overrides: list[str] = ()) -> list[str]:
    out = work / "runs" / run
    common = ["--work", str(work), "--out", str(out), "--draft", budget.get("draft", "eagle3")]
    extra = [arg for item in overrides for arg in ("--override", item)]
    pipeline = pipeline_of(run)
    if pipeline == "draftsmith":
        return [sys.executable, str(BENCH / "peers" / "draftsmith_run.py"), *common, *extra]
    return [str(peer_python(pipeline)), str(BENCH / "peers" / f"{pipeline}_run.py"), *common, *extra]


def finished(record: dict | None) -> bool:
    """Whether a run's record is a finished training: it exited 0 and its head is still there."""
    return (
        bool(record)
        and record.get("returncode") == 0
        and bool(record.get("head"))
        and Path(record["head"]).exists()
    )


def stage_train(work: Path, runs: list[str], budget: dict, results: dict | None = None, save=None,
                ablations: dict[str, list[str]] | None = None, rerun: bool = False,
                judge: bool = False) -> dict:  # fmt: skip
    """Train ``runs`` (and the ``ablations``: run name → overrides, for any pipeline) one at a time into
    ``results``, calling ``save`` after each so a bench cut short keeps the runs that finished. A run whose
    record is already a finished training is kept, not trained again (so a sweep stopped half way goes on
    where it stopped), unless ``rerun``. With ``judge``, each finished run's head is judged on the held-out
    rows right after it trains (``judge_heldout``), so its judgement is kept even if the head is not."""
    results = {} if results is None else results
    ablations = ablations or {}
    for run in [*runs, *ablations]:
        if finished(results.get(run)) and not rerun:
            print(f"peer_training: {run} kept (finished before; --rerun trains it again)", file=sys.stderr)
            continue
        pipeline = pipeline_of(run)
        if pipeline != "draftsmith" and not peer_python(pipeline).exists():
            results[run] = {
                "skipped": f"no venv at {PEER_ROOT / pipeline}: bash scripts/install_peers.sh --train {pipeline}"
            }
            print(f"peer_training: {run} skipped ({results[run]['skipped']})", file=sys.stderr)
            continue
        out = work / "runs" / run
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        print(f"peer_training: training {run} ...", file=sys.stderr, flush=True)
        from draftsmith.eval.report import provenance

        overrides = list(ablations.get(run, []))
        made = provenance(seed=run_seed(overrides, pipeline))  # each run's own, taken as it starts
        timed = run_timed(train_command(run, work, budget, overrides), out.with_suffix(".log"), env)
        report = out / "result.json"
        timed.update(
            json.loads(report.read_text()) if report.exists() else {"error": "no result.json; see the log"}
        )
        timed.update(throughput(timed, budget))
        timed["overrides"], timed["provenance"] = overrides, made
        results[run] = timed
        print(f"peer_training: {run} rc={timed['returncode']} in {timed['wall_s']:.0f} s", file=sys.stderr)
        if save:
            save()
        if judge and finished(timed):
            timed["judge"] = judge_heldout(work, run, timed["head"])
            if save:
                save()
    return results


SEED_KEYS = {
    "draftsmith": "trainer.seed",
    "specforge": "training.seed",
    "speculators": "seed",
    "modelopt": "seed",
}
"""How each pipeline is given a seed (its own words; ModelOpt's recipe has none: its driver takes ``seed``)."""
DEFAULT_SEEDS = {"specforge": 42, "speculators": 42, "modelopt": 0}
"""The seed each peer trains with when none is given (SpecForge's and speculators' config default; the ModelOpt
example's ``torch.manual_seed(0)``); draftsmith's is the quickstart recipe's."""


def run_seed(overrides: list[str], pipeline: str = "draftsmith") -> int:
    """The seed a run trains with: a seed override in the pipeline's own words, else the pipeline's default."""
    for item in overrides:
        key, _, value = item.partition("=")
        if key.split(".")[-1] == "seed":
            return int(value)
    return DEFAULT_SEEDS[pipeline] if pipeline in DEFAULT_SEEDS else quickstart_seed()


def judge_heldout(work: Path, run: str, head: str) -> dict:
    """The one judge a sweep chooses by: ``bench/heldout_tau.py`` on the quickstart recipe's held-out rows
    (never dev), the teacher computed by the float32 target, k = 5: τ along the greedy decoding walk and
    its per-position acceptance, for any pipeline's head (peer layouts read as ``draftsmith eval`` reads
    them). Each pipeline's own held-out metrics stay in its record beside it."""
    out = work / "judge" / f"{run}.json"
    cmd = [sys.executable, str(BENCH / "heldout_tau.py"), "--recipe", "quickstart", "--draft", str(head),
           "--k", str(JUDGE_K), "--out", str(out)]  # fmt: skip
    timed = run_timed(cmd, out.with_suffix(".log"))
    if timed["returncode"] or not out.exists():
        return {"error": f"heldout_tau.py exited {timed['returncode']}; see {timed['log']}", **timed}
    walk = next(iter(json.loads(out.read_text())["drafts"].values()))
    return {"k": JUDGE_K, "tau": walk["walk"]["tau"], "per_position": walk["walk"]["per_position"],
            "steps": walk["walk"]["steps"], "tau_every_start": walk["every_start"]["tau"],
            "command": cmd, "wall_s": timed["wall_s"]}  # fmt: skip


def judge_missing(work: Path, results: dict, save=None) -> None:
    """Judge every finished EAGLE-3 run whose record has no held-out judgement yet (runs kept from before)."""
    for run, record in results.items():
        if finished(record) and "tau" not in (record.get("judge") or {}):
            record["judge"] = judge_heldout(work, run, record["head"])
            if save:
                save()


def throughput(run: dict, budget: dict) -> dict:
    """Tokens/s over the whole run and in steady state (from the end of step 2, or of step 1 when a run
    has fewer than 8 steps, to the end of the last).

    Steady state counts the tokens of those steps where the driver recorded them (``step_tokens``), else
    the mean tokens of a step (all training positions / steps taken), since a peer batches the
    conversations in its own order.
    """
    positions, loss_tokens = budget["train"]["positions"], budget["train"]["loss_tokens"]
    out = {
        "tokens_per_wall_s": positions / run["wall_s"],
        "tokens_per_cpu_s": positions / run["cpu_s"] if run["cpu_s"] else None,
        "loss_tokens_per_wall_s": loss_tokens / run["wall_s"],
    }
    marks = run.get("step_marks") or []  # [(wall, cpu)] at the end of each optimizer step
    skip = 2 if len(marks) >= 8 else 1
    if len(marks) > skip + 1:
        steps = len(marks) - 1 - skip
        counted = run.get("step_tokens") or []
        tokens = sum(counted[skip + 1 :]) if len(counted) == len(marks) else positions / len(marks) * steps
        wall = marks[-1][0] - marks[skip][0]
        cpu = marks[-1][1] - marks[skip][1]
        out["steady_tokens_per_wall_s"] = tokens / wall
        out["steady_tokens_per_cpu_s"] = tokens / cpu if cpu else None
        out["steady_s_per_step"] = wall / steps
    return out


# --------------------------------------------------------------------------- stage: eval


def trained_heads(results: dict) -> dict[str, str]:
    """run: head folder, for the runs whose head is there (peer heads: drafts/eagle_import.py, dflash_import.py)."""
    return {run: r["head"] for run, r in results.items() if r.get("head") and Path(r["head"]).exists()}


def stage_eval(work: Path, results: dict, limit: int, max_new_tokens: int) -> dict:
    heads = trained_heads(results)
    if not heads:
        return {"skipped": "no trained heads"}
    evals = {}
    for k in ("5", "auto"):
        out = work / "eval" / f"k{k}"
        cmd = [sys.executable, "-m", "draftsmith.cli", "eval", "--target", TARGET, "--prompts", "builtin:dev_prompts",
               "--order", "round-robin", "--limit", str(limit), "--max-new-tokens", str(max_new_tokens), "--k", k,
               "--out", str(out), "--overwrite"]  # fmt: skip
        for head in heads.values():
            cmd += ["--draft", str(head)]
        timed = run_timed(cmd, work / "eval" / f"k{k}.log")
        report = out / "report.json"
        timed["report"] = json.loads(report.read_text()) if report.exists() else None
        timed["heads"] = heads
        evals[k] = timed
    return evals


def stage_llamacpp(work: Path, results: dict, limit: int, max_new_tokens: int, k: int = 5) -> dict:
    """Every head through GGUF (``draftsmith export --to gguf``, f16) in llama-server (draft-eagle3, k draft
    tokens a step, greedy) beside the target alone, with the bundled Q4_1 target and its F32 copy: llama.cpp's
    own τ, per-position acceptance and speedup. Dev prompts as the eval stage's, first turn only."""
    import dataclasses

    from transformers import AutoTokenizer

    from draftsmith import llamacpp
    from draftsmith.drafts.base import EAGLE3
    from draftsmith.eval.llamacpp_runs import beside_alone, interleaved_runs
    from draftsmith.eval.prompts import load_prompts, render
    from draftsmith.export.gguf import write_gguf
    from draftsmith.loading import resolve_model_path, smollm2_gguf_path

    if not llamacpp.available():
        return {"skipped": f"llama.cpp is not built (optional extra: {llamacpp.INSTALL})"}
    heads = trained_heads(results)
    folder = work / "llamacpp"
    folder.mkdir(parents=True, exist_ok=True)
    targets = {"q4_1": smollm2_gguf_path(), "f32": folder / "target-f32.gguf"}
    if not targets["f32"].exists():
        write_gguf(resolve_model_path(TARGET)[0], targets["f32"], "f32", smollm2_gguf_path())
    files, exported = {}, {}
    for run, head in heads.items():
        files[run] = folder / f"{run}-f16.gguf"
        cmd = [sys.executable, "-m", "draftsmith.cli", "export", str(head), "--to", "gguf", "--target", TARGET,
               "--out", str(files[run]), "--overwrite"]  # fmt: skip
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        exported[run] = {
            "command": cmd,
            "returncode": done.returncode,
            "tail": done.stdout[-300:] + done.stderr[-600:],
        }
        if done.returncode:
            files.pop(run)
    prompts = [
        dataclasses.replace(q, turns=q.turns[:1])
        for q in load_prompts("builtin:dev_prompts", limit, None, "round-robin")
    ]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(TARGET)[0])
    prompt_ids = [render(tokenizer, [{"role": "user", "content": q.turns[0]}]).tolist() for q in prompts]
    settings = {f"{target}:{run or 'alone'}": (gguf, llamacpp.speculative_args(run and EAGLE3, k, files.get(run)))
                for target, gguf in targets.items() for run in (None, *files)}  # fmt: skip
    with bench_lock() as waited:
        rows = beside_alone(interleaved_runs(settings, prompt_ids, max_new_tokens, folder))
    return {"k": k, "prompts": len(prompt_ids), "max_new_tokens": max_new_tokens, "lock_wait_s": waited,
            "llamacpp": f"llama-cpp-python {llamacpp.LLAMACPP_PY_VERSION} sdist", "exports": exported, "rows": rows}  # fmt: skip


# --------------------------------------------------------------------------- report


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()} ({fields.get('CPU(s)', '?').strip()} CPUs)"


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list):
        return "[" + " ".join(_short(v) for v in value) + "]"
    return str(value)


def print_table(budget: dict, capture_rec: dict | None, results: dict) -> None:
    print(f"\n{budget['train']['positions']} positions ({budget['train']['loss_tokens']} in the loss), "
          f"{budget['train']['conversations']} conversations; draftsmith steps {budget['draftsmith_steps']}")  # fmt: skip
    if capture_rec:
        print(f"stand-in capture (SpecForge + speculators inputs): {capture_rec['wall_s']:.0f} s wall, "
              f"{capture_rec['tokens_per_s']:.0f} tok/s")  # fmt: skip
    head = f"{'run':<22} {'rc':>3} {'steps':>6} {'wall s':>8} {'CPU s':>8} {'tok/s':>7} {'tok/CPU-s':>9} "
    head += (
        f"{'steady tok/s':>12} {'steady tok/CPU-s':>16} {'peak MB':>8} {'judge τ':>7}  own held-out metrics"
    )
    print(head)
    for run, r in results.items():
        if "skipped" in r:
            print(f"{run:<22} skipped: {r['skipped']}")
            continue

        def num(key, row=r):
            value = row.get(key)
            return format(value, ".0f") if isinstance(value, (int, float)) else "-"

        held = r.get("heldout") or {}
        held_text = " ".join(f"{k}={_short(v)}" for k, v in held.items())
        judged = (r.get("judge") or {}).get("tau")
        judged_text = "-" if judged is None else f"{judged:.3f}"
        print(f"{run:<22} {r['returncode']:>3} {len(r.get('step_marks') or []):>6} {num('wall_s'):>8} "
              f"{num('cpu_s'):>8} {num('tokens_per_wall_s'):>7} {num('tokens_per_cpu_s'):>9} "
              f"{num('steady_tokens_per_wall_s'):>12} {num('steady_tokens_per_cpu_s'):>16} "
              f"{num('peak_rss_mb'):>8} {judged_text:>7}  {held_text}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--tokens", type=int, default=16384, help="training positions per run (rounded up to whole batches)"
    )
    p.add_argument(
        "--work", type=Path, default=Path("runs/peer_training"), help="data, features, heads, logs"
    )
    p.add_argument(
        "--runs",
        nargs="*",
        default=list(RUNS),
        choices=RUNS,
        help="peers and draftsmith (none: only the --ablation and --setting runs)",
    )
    p.add_argument("--ablation", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="also train draftsmith's recipe with these overrides, as run draftsmith-NAME (repeatable; "
                   "trainer.batch_size keeps the rows, not the steps)")  # fmt: skip
    p.add_argument("--setting", action="append", default=[], metavar="PIPELINE-NAME:KEY=VALUE[,KEY=VALUE]",
                   help="also train PIPELINE with its own settings changed, as run PIPELINE-NAME (repeatable; a "
                   "sweep): draftsmith and ModelOpt take recipe keys (optim.lr=1e-4; training.learning_rate=3e-4), "
                   "SpecForge its config keys (training.learning_rate=3e-4, training.warmup_ratio=0.05, "
                   "training.batch_size=2, training.seed=1), speculators its flags without dashes (lr=3e-4, "
                   "scheduler-warmup-steps=5, total-seq-len=4096, seed=1)")  # fmt: skip
    p.add_argument(
        "--rerun",
        action="store_true",
        help="train runs again that the --out record already holds as finished (default: keep them)",
    )
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--draft", choices=("eagle3", "dflash"), default="eagle3", help="draft kind (data stage)")
    p.add_argument("--eval-limit", type=int, default=12, help="dev prompts in each eval run")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", type=Path, default=Path("bench/results/peer_training.json"))
    args = p.parse_args(argv)
    work = args.work.resolve()
    record = json.loads(args.out.read_text()) if args.out.exists() else {}
    from draftsmith.eval.report import provenance

    record.update({"date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "target": TARGET,
                   "data": list(QUICKSTART_DATA), "work": str(work), "provenance": provenance(seed=quickstart_seed())})  # fmt: skip

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1, default=str))
        tmp.replace(args.out)

    if "data" in args.stages:
        record["budget"] = stage_data(work, args.tokens, args.draft)
    budget = json.loads((work / "data" / "budget.json").read_text())
    record["budget"] = budget
    if "capture" in args.stages:
        record["capture"] = stage_capture(work)
        save()
    if "train" in args.stages:
        ablations = dict(parse_ablation(a) for a in args.ablation) | dict(
            parse_setting(s) for s in args.setting
        )
        judge = "judge" in args.stages and budget.get("draft", "eagle3") == "eagle3"
        stage_train(
            work, args.runs, budget, record.setdefault("train", {}), save, ablations, args.rerun, judge
        )
    if "judge" in args.stages and budget.get("draft", "eagle3") == "eagle3":
        judge_missing(work, record.get("train", {}), save)
    for run in record.get("train", {}).values():  # rates from the marks, also for runs kept from before
        if "wall_s" in run:
            run.update(throughput(run, budget))
    if "eval" in args.stages:
        record["eval"] = stage_eval(work, record.get("train", {}), args.eval_limit, args.max_new_tokens)
    if "llamacpp" in args.stages:
        record["llamacpp"] = stage_llamacpp(
            work, record.get("train", {}), args.eval_limit, args.max_new_tokens
        )
    save()
    from draftsmith.eval.llamacpp_runs import print_judged

    print_table(budget, record.get("capture"), record.get("train", {}))
    print_judged(record.get("eval") or {}, (record.get("llamacpp") or {}).get("rows") or {})
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
