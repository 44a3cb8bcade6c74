"""``draftsmith publish``: the folder it builds, the card it renders from a real eval report, the push."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
import yaml
from tiny import tiny_model, tiny_target, tiny_tokenizer
from transformers import AutoModelForCausalLM

from draftsmith.cli import main
from draftsmith.decode.sampling import Sampling
from draftsmith.decode.speculative import generate
from draftsmith.draft_checkpoint import locate_checkpoint
from draftsmith.drafts import distill
from draftsmith.drafts.base import build_drafter
from draftsmith.drafts.eagle import EagleConfig, EagleHead
from draftsmith.drafts.eagle_parts import build_vocab_map
from draftsmith.publish.report import find_report

TOKEN = "hf_sentinelTOKENnever0to1be2written"
RECIPE = "target:\n  spec: tiny\ndata:\n  paths: [prompts.jsonl, org/chat-data]\ndraft:\n  kind: eagle3\n"
PROMPTS = [
    {"question_id": 1, "category": "chat", "turns": ["Tell me about cats."]},
    {"question_id": 2, "category": "code", "turns": ["def add(a, b): return a + b"]},
]


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=8)


@pytest.fixture(autouse=True)
def fake_token(monkeypatch):
    """A token as huggingface_hub would find it in the environment; it must never leave it."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)


@pytest.fixture(scope="module")
def run(target, tmp_path_factory):
    """A run directory: an EAGLE-3 head, a distilled draft, the recipe, and a real `draftsmith eval` report."""
    root = tmp_path_factory.mktemp("work")
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(target, draft_vocab_size=120))
    head.set_vocab_map(*build_vocab_map(torch.rand(target.vocab_size), 120))
    head.init_from_target(target.model)
    head.save_pretrained(root / "run" / "draft")
    small = distill.from_target_layers(target, [0, 1]).eval()
    distill.save_draft(small, target.tokenizer, target, root / "small" / "draft")
    for name in ("run", "small"):
        (root / name / "config.yaml").write_text(RECIPE)
    tiny_model("llama", layers=8).save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return root


def run_eval(root, draft: str, out: str, monkeypatch) -> None:
    monkeypatch.chdir(root)
    argv = [
        "eval",
        "--target",
        "target",
        "--draft",
        draft,
        "--prompts",
        "prompts.jsonl",
        "--max-new-tokens",
        "12",
    ]
    assert main([*argv, "--k", "3", "--warmup", "0", "--out", out]) == 0


@pytest.fixture(scope="module")
def evaluated(run):
    with pytest.MonkeyPatch.context() as mp:
        run_eval(run, "run/draft", "run/eval", mp)
        run_eval(run, "small/draft", "small/eval", mp)
    return run


def publish(root, ckpt: str, *extra: str) -> int:
    return main(
        [
            "publish",
            str(root / ckpt),
            "--repo-id",
            "me/tiny-draft",
            "--base-model",
            "org/tiny-target",
            "--license",
            "mit",
            "--out",
            str(root / f"pub-{ckpt}"),
            *extra,
        ]
    )


def test_dry_run_eagle_folder_loads_with_identical_logits_and_greedy_decoding(evaluated, target, capsys):
    assert publish(evaluated, "run", "--dry-run") == 0
    listing = capsys.readouterr().out
    folder = evaluated / "pub-run"
    for name in (
        "model.safetensors",
        "config.json",
        "README.md",
        "acceptance.png",
        "eval_report.json",
        "train_config.yaml",
    ):
        assert (folder / name).is_file() and name in listing
    original = EagleHead.from_pretrained(evaluated / "run" / "draft").eval()
    published = EagleHead.from_pretrained(folder).eval()
    ids = torch.tensor([[5, 17, 99, 3]])
    features = {i: torch.randn(1, 4, 32) for i in original.config.capture_layer_ids}
    with torch.no_grad():
        assert torch.equal(
            published(ids, features, steps=2).logits[1], original(ids, features, steps=2).logits[1]
        )
    assert torch.equal(published.d2t, original.d2t) and torch.equal(published.t2d, original.t2d)
    drafters = [build_drafter(str(d), target) for d in (evaluated / "run" / "draft", folder)]
    for prompt in (torch.tensor([1, 60, 61, 62, 60, 61]), torch.tensor([7, 8, 9, 200, 31])):
        assert greedy_proposal(drafters[0], target, prompt) == greedy_proposal(drafters[1], target, prompt)
        runs = [generate(target, prompt, d, 3, 16) for d in drafters]
        assert runs[0].tokens == runs[1].tokens and runs[0].accepted == runs[1].accepted
        assert runs[0].tokens == generate(target, prompt, None, 0, 16).tokens  # and both are the target's own


def greedy_proposal(drafter, target, prompt, k: int = 5) -> list[int]:
    """The k tokens the drafter drafts greedily after the target's prefill of ``prompt``."""
    target.set_capture(drafter.capture_layers)
    target.reset()
    step = target.forward(prompt)
    drafter.begin(prompt, step.features)
    tokens = torch.cat([prompt, step.logits[-1].argmax().view(1)])
    return drafter.propose(tokens, k, Sampling(), None).tokens.tolist()


def test_dry_run_small_draft_folder_is_an_ordinary_causal_lm(evaluated):
    assert publish(evaluated, "small", "--dry-run") == 0
    folder = evaluated / "pub-small"
    assert (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()
    original = AutoModelForCausalLM.from_pretrained(evaluated / "small" / "draft").eval()
    published = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[5, 17, 99, 3]])
    with torch.no_grad():
        assert torch.equal(published(ids).logits, original(ids).logits)
        kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(published.generate(ids, **kw), original.generate(ids, **kw))


def card_of(folder):
    text = (folder / "README.md").read_text()
    _, meta, body = text.split("---", 2)
    return yaml.safe_load(meta), body


def test_card_renders_the_metrics_of_the_real_eval_report(evaluated):
    assert publish(evaluated, "run", "--dry-run") == 0
    report = json.loads((evaluated / "run" / "eval" / "report.json").read_text())
    entry = next(d for d in report["drafts"] if d["name"] == "run/draft")
    meta, body = card_of(evaluated / "pub-run")
    assert meta["base_model"] == "org/tiny-target" and meta["license"] == "mit"
    assert meta["library_name"] == "draftsmith" and "eagle3" in meta["tags"]
    assert meta["datasets"] == [
        "org/chat-data"
    ]  # the Hub id among the recipe's data paths, not the local file
    all_row = next(line for line in body.splitlines() if line.startswith("| **all** |"))
    assert (
        f"{entry['tau']:.2f}" in all_row
        and f"{entry['alpha']:.2f}" in all_row
        and f"{entry['speedup']:.2f}×" in all_row
    )
    for cat in report["categories"]:
        row = next(line for line in body.splitlines() if line.startswith(f"| {cat} |"))
        assert f"{entry['categories'][cat]['tau']:.2f}" in row
    pos_row = next(line for line in body.splitlines() if line.startswith("| P(accept) |"))
    assert pos_row.count("|") == len(entry["per_position"]) + 2
    assert report["hardware"] in body and "k = 3" in body and "prompts.jsonl" in body
    assert "![per-position acceptance and τ by category](acceptance.png)" in body
    assert "kind: eagle3" in body  # the recipe
    for engine in ("vLLM", "SGLang", "transformers"):
        assert f"### {engine}" in body
    assert "--to vllm" in body and '"method": "eagle3"' in body


def test_report_lookup_picks_the_newest_report_that_measured_this_checkpoint(evaluated, monkeypatch):
    ckpt = locate_checkpoint(str(evaluated / "run"))
    assert find_report(ckpt).path == (evaluated / "run" / "eval" / "report.json").resolve()
    run_eval(evaluated, "run/draft", "run/eval2", monkeypatch)
    monkeypatch.chdir("/")  # the lookup must not depend on the current directory
    try:
        assert find_report(ckpt).path.parent.name == "eval2"
    finally:
        shutil.rmtree(evaluated / "run" / "eval2")
    other = locate_checkpoint(str(evaluated / "small"))
    with pytest.raises(ValueError, match="none of which"):
        find_report(other, str(evaluated / "run" / "eval"))


def test_publish_without_a_report_is_a_clear_error(run, tmp_path):
    (tmp_path / "draft").symlink_to(run / "run" / "draft", target_is_directory=True)
    args = [
        "publish",
        str(tmp_path / "draft"),
        "--repo-id",
        "me/x",
        "--base-model",
        "a/b",
        "--license",
        "mit",
    ]
    assert main([*args, "--dry-run", "--out", str(tmp_path / "p")]) == 2
    assert main([*args, "--dry-run", "--no-eval", "--out", str(tmp_path / "p")]) == 0
    _, body = card_of(tmp_path / "p")
    assert "Not measured yet." in body


def test_push_commits_exactly_the_folder_and_never_the_token(evaluated, monkeypatch, capsys):
    calls = {}

    def create_repo(self, repo_id, **kwargs):
        calls["repo"] = (repo_id, kwargs)

    def create_branch(self, repo_id, branch, **kwargs):
        calls["branch"] = branch

    def create_commit(self, repo_id, operations, **kwargs):
        calls["commit"] = (repo_id, list(operations), kwargs)
        return huggingface_hub.CommitInfo(
            commit_url=f"https://huggingface.co/{repo_id}/commit/abc",
            commit_message="m",
            commit_description="",
            oid="abc",
            pr_url=None,
        )

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_branch", create_branch)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", create_commit)
    assert publish(evaluated, "run", "--private", "--revision", "v1") == 0
    folder = evaluated / "pub-run"
    repo_id, operations, kwargs = calls["commit"]
    assert repo_id == "me/tiny-draft" and calls["repo"][1]["private"] is True and calls["branch"] == "v1"
    assert kwargs["revision"] == "v1" and "token" not in kwargs
    on_disk = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert sorted(op.path_in_repo for op in operations) == on_disk
    for op in operations:
        content = (folder / op.path_in_repo).read_bytes()
        assert TOKEN.encode() not in content
        assert TOKEN not in repr(op)
    assert TOKEN not in capsys.readouterr().out


def test_push_refuses_without_a_token_and_refuses_a_folder_holding_it(evaluated, monkeypatch, tmp_path):
    with monkeypatch.context() as mp:
        mp.delenv("HF_TOKEN")
        mp.setattr(huggingface_hub, "get_token", lambda: None)  # no stored login either
        assert publish(evaluated, "run") == 2
    (evaluated / "run" / "draft" / "notes.txt").write_text(f"token={TOKEN}")
    try:
        assert publish(evaluated, "run", "--dry-run") == 2
    finally:
        (evaluated / "run" / "draft" / "notes.txt").unlink()


def test_the_published_folder_names_files_not_where_they_lay_on_this_disk(evaluated, tmp_path):
    """Recipe and report keep file names (with a content hash), never this machine's absolute paths."""
    import hashlib

    data = evaluated / "prompts.jsonl"
    run = tmp_path / "abs-run"
    shutil.copytree(evaluated / "run" / "draft", run / "draft")
    (run / "config.yaml").write_text(
        yaml.safe_dump({"data": {"paths": [str(data), "org/chat-data"]}, "output": {"dir": str(run)}})
    )
    report = json.loads((evaluated / "run" / "eval" / "report.json").read_text())
    report["settings"]["prompts"] = str(data)
    for d in report["drafts"]:
        if d["name"] == "run/draft":
            d["name"] = str(run / "draft")
    (run / "eval").mkdir()
    (run / "eval" / "report.json").write_text(json.dumps(report))
    out = tmp_path / "pub"
    assert main(["publish", str(run), "--repo-id", "me/x", "--base-model", "a/b", "--license", "mit",
                 "--out", str(out), "--dry-run"]) == 0  # fmt: skip
    digest = hashlib.sha256(data.read_bytes()).hexdigest()[:12]
    for name in ("README.md", "train_config.yaml", "eval_report.json"):
        text = (out / name).read_text()
        assert str(tmp_path) not in text and str(evaluated) not in text, name
    assert f"prompts.jsonl (sha256 {digest})" in (out / "README.md").read_text()
    assert "org/chat-data" in (out / "train_config.yaml").read_text()  # a Hub id stays as it is
    assert json.loads((out / "eval_report.json").read_text())["drafts"][0]["name"] == "me/x"


@pytest.mark.parametrize("ckpt", ["run", "small"])
def test_the_cards_python_snippets_run(evaluated, ckpt, monkeypatch):
    """The card's Python is code that works: run with the repo id and base model pointing at local folders."""
    import re

    assert publish(evaluated, ckpt, "--dry-run") == 0
    body = (evaluated / f"pub-{ckpt}" / "README.md").read_text()
    snippets = re.findall(r"```python\n(.*?)```", body, flags=re.S)
    assert snippets
    monkeypatch.chdir(evaluated)
    for code in snippets:
        code = code.replace("me/tiny-draft", str(evaluated / f"pub-{ckpt}")).replace(
            "org/tiny-target", "target"
        )
        namespace: dict = {}
        exec(compile(code, f"README.md of {ckpt}", "exec"), namespace)
        target = namespace["target"]
        if ckpt == "small":  # assisted generation returned the target's own greedy tokens
            plain = target.generate(**namespace["inputs"], max_new_tokens=128, do_sample=False)
            assert torch.equal(namespace["out"], plain)
        else:
            assert namespace["out"].tokens == generate(target, namespace["prompt"], None, 0, 128).tokens


def test_publish_without_a_network_says_so_in_one_line_and_keeps_the_folder(evaluated, monkeypatch, capsys):
    """A real connection failure (a closed local port as the Hub), not a mocked exception."""
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    assert publish(evaluated, "run") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "could not reach 127.0.0.1:9" in err and "nothing was published" in err and "again" in err
    assert (evaluated / "pub-run" / "README.md").is_file()  # the folder stays ready


def test_a_report_that_measured_the_run_folder_is_this_runs_report(evaluated, monkeypatch):
    """`draftsmith eval --draft RUN` measured RUN/draft (eval reads a run folder so): publish takes its report."""
    run_eval(evaluated, "run", "run/eval-run", monkeypatch)
    report = evaluated / "run" / "eval-run"
    try:
        ckpt = locate_checkpoint(str(evaluated / "run"))
        assert find_report(ckpt, str(report)).entry["name"] == "run"
        monkeypatch.chdir("/")  # found from the report's own --out, not the current directory
        assert find_report(ckpt).path == (report / "report.json").resolve()  # the newest, without --report
        assert publish(evaluated, "run", "--report", str(report), "--dry-run") == 0
        with pytest.raises(
            ValueError, match="none of which"
        ):  # another checkpoint still is not measured by it
            find_report(locate_checkpoint(str(evaluated / "small")), str(report))
    finally:
        shutil.rmtree(report)


def test_a_publish_removes_what_a_killed_build_of_its_folder_left(evaluated):
    import tempfile

    left = Path(tempfile.mkdtemp(dir=evaluated, prefix=".pub-run.tmp-"))  # the name a build is made under
    (left / "model.safetensors").write_bytes(bytes(1024))
    assert publish(evaluated, "run", "--dry-run") == 0
    assert not left.exists() and (evaluated / "pub-run" / "README.md").is_file()
