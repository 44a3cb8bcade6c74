"""What every stage of the peer-training bench shares: paths and constants, the machine-wide bench lock, a timed
run under it, each peer's python, run names (``--setting`` / ``--ablation``) and the seed each run trains with."""

from __future__ import annotations

import fcntl
import os
import platform
import subprocess
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
PEER_ROOT = Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith")) / "peers"
PEERS = ("modelopt", "specforge", "speculators")
RUNS = (*PEERS, "draftsmith")
LOCK = Path("/tmp/draftsmith-bench.lock")
TARGET = "smollm2-135m-instruct"
STAGES = ("data", "capture", "train", "judge", "eval", "llamacpp")
JUDGE_K = 5
QUICKSTART_DATA = ("builtin:sharegpt_1000", "builtin:gsm8k_train", "builtin:gpteacher_codegen")


def quickstart_seed() -> int:
    """The seed every pipeline's rows and draftsmith's run are drawn with: the quickstart recipe's."""
    from draftsmith.train.config import load_config

    return load_config("quickstart").trainer.seed


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


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    return f"{fields.get('Model name', '?').strip()} ({fields.get('CPU(s)', '?').strip()} CPUs)"


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
