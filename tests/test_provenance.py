"""A result's commit pins the code that made it: rewriting a results file or a doc leaves HEAD's commit
clean, a changed (or new) code file marks it ``+dirty`` with a hash of the difference."""

import subprocess

import pytest
from benchlib import records


def git(repo, *cmd):
    return subprocess.run(
        ["git", "-C", str(repo), *cmd], capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A throwaway checkout laid out like draftsmith's, one commit, and ``provenance()`` pointed at it."""
    files = {"train/loop.py": "x = 1\n", "bench/results/run.json": "{}\n", "bench/sweep.py": "pass\n",
             "docs/guide.txt": "old\n", "README.md": "# old\n", "configs/tiny.yaml": "k: 1\n"}  # fmt: skip
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    git(tmp_path, "add", ".")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    monkeypatch.setattr(records, "REPO_ROOT", tmp_path)
    return tmp_path


def test_a_rewritten_result_or_doc_leaves_heads_commit_clean(repo):
    head = git(repo, "rev-parse", "HEAD")
    (repo / "bench/results/run.json").write_text('{"tau": 2.0}\n')
    (repo / "docs/guide.txt").write_text("new\n")
    (repo / "README.md").write_text("# new\n")
    (repo / "bench/results/new.json").write_text("{}\n")
    made = records.provenance(seed=0)
    assert made["commit"] == head
    assert made["diff_sha256"] is None


@pytest.mark.parametrize("change", ["train/loop.py", "bench/sweep.py", "configs/tiny.yaml", "train/new.py"])
def test_changed_code_marks_the_commit_dirty_with_a_hash_of_the_difference(repo, change):
    head = git(repo, "rev-parse", "HEAD")
    (repo / "bench/results/run.json").write_text('{"tau": 2.0}\n')
    (repo / change).write_text("changed = True\n")
    made = records.provenance(seed=0)
    assert made["commit"] == head + "+dirty"
    assert len(made["diff_sha256"]) == 16 and int(made["diff_sha256"], 16) >= 0
    (repo / change).write_text("changed = False\n")
    assert records.provenance(seed=0)["diff_sha256"] != made["diff_sha256"], "the hash names the difference"


def test_outside_a_checkout_there_is_no_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "REPO_ROOT", tmp_path)
    assert records.code_commit(tmp_path) == {"commit": None, "diff_sha256": None}
