"""Hub ids as draft / target / checkpoint arguments (draftsmith/hub.py), with the download mocked: no network."""

from __future__ import annotations

import httpx2  # huggingface_hub's HTTP client; its errors carry a response
import huggingface_hub
import pytest
from huggingface_hub import errors as hub_errors
from tiny import tiny_target

from draftsmith.draft_checkpoint import locate_checkpoint
from draftsmith.drafts import distill
from draftsmith.hub import is_hub_id, resolve_pretrained


class FakeHub:
    """snapshot_download stand-in: serves ``repos`` from the cache or the network, records every call."""

    def __init__(self, repos: dict, cached: set, online: bool = True):
        self.repos, self.cached, self.online, self.calls = repos, cached, online, []

    def __call__(self, repo_id, revision=None, local_files_only=False, **kwargs):
        self.calls.append((repo_id, revision, local_files_only))
        if local_files_only or not self.online:
            if repo_id in self.cached:
                return str(self.repos[repo_id])
            raise hub_errors.LocalEntryNotFoundError("not in the cache and outgoing traffic is disabled")
        if repo_id not in self.repos:
            request = httpx2.Request("GET", f"https://huggingface.co/api/models/{repo_id}")
            raise hub_errors.RepositoryNotFoundError(
                "404: Repository Not Found", response=httpx2.Response(404, request=request)
            )
        self.cached.add(repo_id)
        return str(self.repos[repo_id])


@pytest.fixture()
def draft_repo(tmp_path):
    target = tiny_target("llama")
    return distill.save_draft(
        distill.from_config(target, 1, 16, seed=0), target.tokenizer, target, tmp_path / "snap"
    )


def test_local_paths_and_aliases_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub({}, set()))
    (tmp_path / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_pretrained("a/b") == "a/b" and not is_hub_id("a/b")
    assert resolve_pretrained("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert huggingface_hub.snapshot_download.calls == []


def test_a_hub_id_is_downloaded_once_then_read_from_the_cache(draft_repo, monkeypatch):
    hub = FakeHub({"org/draft": draft_repo}, set())
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub)
    assert resolve_pretrained("org/draft@v2") == str(draft_repo)
    assert hub.calls == [("org/draft", "v2", True), ("org/draft", "v2", False)]
    hub.calls.clear()
    assert resolve_pretrained("org/draft@v2") == str(draft_repo)
    assert hub.calls == [("org/draft", "v2", True)]  # cached: no network


def test_offline_and_missing_ids_are_clear_errors(monkeypatch):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub({}, set(), online=False))
    with pytest.raises(FileNotFoundError, match=r"draft 'org/draft'.*needs network once"):
        resolve_pretrained("org/draft", what="draft")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub({}, set()))
    with pytest.raises(FileNotFoundError, match="has no repository 'org/nope'"):
        resolve_pretrained("org/nope", what="target")


def test_checkpoints_can_be_hub_ids(draft_repo, tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub({"org/draft": draft_repo}, set()))
    ckpt = locate_checkpoint("org/draft")
    assert (
        ckpt.kind.name == "distill" and ckpt.draft_dir == draft_repo and ckpt.target["name"] == "tiny-llama"
    )
    head_dir = tmp_path / "head"
    from draftsmith.drafts.eagle import EagleConfig, EagleHead

    EagleHead(EagleConfig.for_target(tiny_target("llama", layers=8), draft_vocab_size=50)).save_pretrained(
        head_dir
    )
    monkeypatch.setattr(huggingface_hub, "snapshot_download", FakeHub({"org/head": head_dir}, {"org/head"}))
    assert locate_checkpoint("org/head").kind.name == "eagle3"
