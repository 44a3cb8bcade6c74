"""The eval stage (``draftsmith eval`` over every trained head) and the llamacpp stage (every head through GGUF
in llama-server)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .common import REPO, TARGET, bench_lock, run_timed


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

    from benchlib.llamacpp_runs import beside_alone, interleaved_runs
    from transformers import AutoTokenizer

    from draftsmith import llamacpp
    from draftsmith.drafts.base import EAGLE3
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
