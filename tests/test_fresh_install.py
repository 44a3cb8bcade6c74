"""A fresh machine works: the committed HEAD, cloned into an empty folder with nothing beside it, built
into a wheel and installed into a new virtual environment, runs the main job's whole path in small
(train a few steps, eval two prompts, publish --dry-run, export --to gguf) from an empty working
directory, and reads nothing of the developer's checkout or of a data folder beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
READ_GUARD = """
import os, sys
forbidden = [p for p in os.environ["DRAFTSMITH_TEST_FORBID"].split(os.pathsep) if p]
allowed = [p for p in os.environ["DRAFTSMITH_TEST_ALLOW"].split(os.pathsep) if p]
log = os.environ["DRAFTSMITH_TEST_READS"]

def under(path, roots):
    return any(path == r or path.startswith(r + os.sep) for r in roots)

def guard(event, args):
    if event not in ("open", "os.listdir", "os.scandir") or not args or isinstance(args[0], int):
        return
    try:
        path = os.path.abspath(os.fsdecode(args[0] if args[0] is not None else "."))
    except (TypeError, ValueError):
        return
    if path != log and under(path, forbidden) and not under(path, allowed):
        with open(log, "a") as f:
            f.write(f"{event} {path} (pid {os.getpid()})\\n")

sys.addaudithook(guard)
"""
"""A ``sitecustomize`` for every Python process of the test: it records each open or listing of a path
in the developer's checkout (its .venv aside, where the dependencies come from) or in a ``shared``
folder beside the checkout or the clone."""


def run(*cmd, **kwargs) -> str:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kwargs)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out.stdout


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """(draftsmith executable, python, environment, working directory, reads log) of a wheel built from
    a clone of HEAD and installed into a new venv; the dependencies (torch, transformers, the bundled
    target, ...) come from this environment through PYTHONPATH, draftsmith only from the wheel."""
    base = tmp_path_factory.mktemp("fresh")
    clone = base / "clone"
    run("git", "clone", "-q", "--no-hardlinks", ROOT, clone)
    dist = base / "dist"
    run(sys.executable, "-m", "pip", "wheel", clone, "--no-deps", "--no-build-isolation", "-q", "-w", dist)
    (wheel,) = dist.glob("draftsmith-*.whl")
    venv = base / "venv"
    run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel)
    guard = base / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(READ_GUARD)
    reads = base / "reads.log"
    here_venv = Path(sys.prefix)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(guard), sysconfig.get_paths()["purelib"]]),
        "DRAFTSMITH_TEST_FORBID": os.pathsep.join(
            str(p) for p in (ROOT, ROOT.parent / "shared", base / "shared", clone.parent / "shared")
        ),
        "DRAFTSMITH_TEST_ALLOW": str(here_venv),
        "DRAFTSMITH_TEST_READS": str(reads),
        "TQDM_DISABLE": "1",
    }
    work = base / "work"  # an empty working directory
    work.mkdir()
    return venv / "bin" / "draftsmith", python, env, work, reads


@pytest.mark.slow
def test_the_wheel_runs_outside_the_repository_and_finds_recipes_and_data(fresh):
    draftsmith, python, env, work, reads = fresh
    where = run(python, "-c", "import draftsmith; print(draftsmith.__file__)", cwd=work, env=env)
    assert str(python.parents[1]) in where and str(ROOT) not in where
    assert "train" in run(draftsmith, "--help", cwd=work, env=env)
    assert "config keys" in run(draftsmith, "train", "--help", cwd=work, env=env)
    recipe = "from draftsmith.train.config import load_config; print(load_config('configs/quickstart.yaml').trainer.max_steps, load_config('quickstart', presets=['ddp']).trainer.strategy)"
    shipped = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())["trainer"]["max_steps"]
    # the wheel's own copy of the recipe, as shipped
    assert run(python, "-c", recipe, cwd=work, env=env).split() == [str(shipped), "ddp"]
    listing = run(draftsmith, "data", "list", cwd=work, env=env)
    assert "builtin:dev_prompts" in listing and "1,194 records" in listing
    assert str(python.parents[1]) in listing and str(ROOT) not in listing
    assert not reads.exists(), reads.read_text()
    # the guard itself: a read of the checkout is recorded (then forgotten, for the next test)
    run(python, "-c", f"open({str(ROOT / 'README.md')!r}).close()", cwd=work, env=env)
    assert f"open {ROOT / 'README.md'}" in reads.read_text()
    reads.unlink()


@pytest.mark.slow
def test_the_main_job_runs_end_to_end_from_a_fresh_install(fresh):
    """quickstart --smoke (train 3 steps, eval 2 prompts), then the two next steps it prints; the GGUF export the
    recipe's head cannot carry is refused, naming the option."""
    draftsmith, _, env, work, reads = fresh
    out = run(draftsmith, "quickstart", "--smoke", "--out", "runs/qs", cwd=work, env=env)
    assert "[quickstart] done." in out
    report = json.loads((work / "runs/qs/eagle3/eval/report.json").read_text())
    assert report["settings"]["num_prompts"] == 2
    assert all(d["exact_match"] for d in report["drafts"]), "speculative output differs from the target's"
    card = run(
        draftsmith, "publish", "runs/qs/eagle3", "--repo-id", "me/smoke-head", "--dry-run", cwd=work, env=env
    )
    assert "model.safetensors" in card
    run(draftsmith, "export", "runs/qs/eagle3", "--to", "vllm", cwd=work, env=env)
    exported = json.loads((work / "runs/qs/eagle3/export-vllm/config.json").read_text())
    assert (
        exported["norm_output"] is True and exported["norm_before_fc"] is True
    )  # the recipe's EAGLE-3.1 norms
    # llama.cpp's eagle3 graph feeds the pre-norm state back: the head's norm_output is refused by name
    refused = subprocess.run([str(draftsmith), "export", "runs/qs/eagle3", "--to", "gguf"], cwd=work, env=env,
                             capture_output=True, text=True, timeout=900)  # fmt: skip
    assert refused.returncode == 2 and "norm_output" in refused.stderr and "llama.cpp" in refused.stderr
    assert not list((work / "runs/qs/eagle3").glob("export-gguf/*.gguf"))
    assert not reads.exists(), "read outside the installation:\n" + reads.read_text()[:3000]
