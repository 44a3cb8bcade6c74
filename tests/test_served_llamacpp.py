"""``draftsmith data regenerate --engine llamacpp`` end to end: a real llama-server on the bundled target,
killed with SIGKILL mid-run, and the rerun writes every row once, in input order.

Needs the optional llama.cpp build (``bash scripts/install_llamacpp.sh``) and the real bundled target.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftsmith import llamacpp
from draftsmith.sources import BUILTIN_TRAIN
from draftsmith.train.corpus.prompts import first_user_turns

pytestmark = [
    pytest.mark.slow,
    pytest.mark.engine,
    pytest.mark.skipif(
        not llamacpp.available(), reason=f"llama.cpp is not built (optional extra: {llamacpp.INSTALL})"
    ),
]
COUNT = 24


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # the field after the state is the parent's pid
            found.append(int(stat.parent.name))
    return found


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_llamacpp_engine_killed_mid_run_resumes_every_row_once_in_order(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in first_user_turns(list(BUILTIN_TRAIN), COUNT)))
    out = tmp_path / "regenerated.jsonl"
    cmd = [sys.executable, "-m", "draftsmith.cli", "data", "regenerate", "--engine", "llamacpp",
           "--target", "smollm2-135m-instruct", "--data", str(prompts), "--out", str(out),
           "--max-new-tokens", "48", "--batch-size", "2"]  # fmt: skip
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and job.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 3:
            break
        time.sleep(0.05)
    assert job.poll() is None, (
        f"the job ended before it could be killed: {job.stderr.read().decode()[-2000:]}"
    )
    servers = children(job.pid)
    assert servers, "llama-server should be running under the job"
    os.kill(job.pid, signal.SIGKILL)  # a node lost mid-run
    job.wait()
    for _ in range(100):  # the server dies with the job that started it
        if not any(Path(f"/proc/{pid}").exists() for pid in servers):
            break
        time.sleep(0.05)
    assert not any(Path(f"/proc/{pid}").exists() for pid in servers), "llama-server outlived the killed job"
    done = rows(out) if out.read_text().endswith("\n") else rows(out)[:-1]
    assert 3 <= len(done) < COUNT

    finished = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-2000:]
    written = rows(out)
    ids = [f"prompts.jsonl:{i}" for i in range(COUNT)]
    assert [r["source_id"] for r in written] == ids  # every row once, in input order
    assert all(r["generator"]["engine"] == "llama.cpp" for r in written)
    assert written[0]["generator"]["weights"].endswith("Q4_1.gguf")
    assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"] for r in written)
