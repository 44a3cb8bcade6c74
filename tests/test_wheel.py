"""``pip install .`` works: a wheel built from the checkout, installed into a fresh virtual environment, runs
outside the repository and finds its shipped recipes by name."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*cmd, **kwargs) -> str:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kwargs)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out.stdout


def test_a_wheel_installs_and_runs_outside_the_repository(tmp_path):
    source = tmp_path / "source"  # a copy: the build writes build/ and egg-info beside the sources
    skip = shutil.ignore_patterns(".git", ".venv", "runs", "build", "*.egg-info", "__pycache__", ".gl")
    shutil.copytree(ROOT, source, ignore=skip)
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "pip", "wheel", source, "--no-deps", "--no-build-isolation", "-q", "-w", dist)
    (wheel,) = dist.glob("draftsmith-*.whl")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv)
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel)
    # the dependencies (torch, transformers, ...) come from this environment; draftsmith from the wheel
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    where = run(python, "-c", "import draftsmith; print(draftsmith.__file__)", cwd=tmp_path, env=env)
    assert str(venv) in where and str(ROOT) not in where
    assert "train" in run(venv / "bin" / "draftsmith", "--help", cwd=tmp_path, env=env)
    assert "config keys" in run(venv / "bin" / "draftsmith", "train", "--help", cwd=tmp_path, env=env)
    recipe = "from draftsmith.train.config import load_config; print(load_config('configs/quickstart.yaml').trainer.max_steps, load_config('quickstart', presets=['ddp']).trainer.strategy)"
    assert run(python, "-c", recipe, cwd=tmp_path, env=env).split() == ["200", "ddp"]
