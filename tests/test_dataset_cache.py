"""The rendered, packed rows are kept on disk: a second start renders nothing, any change to the data, the
tokenizer, its template or the settings makes a new entry, and an entry that does not read back is rebuilt."""

from __future__ import annotations

import json

import pytest
import torch
from test_loop import conversations, make_config  # noqa: F401 (fixture)
from tiny import CHATML, tiny_tokenizer

import draftsmith.train.corpus.tokens as tokens
from draftsmith.train.corpus.dataset_cache import cached_dataset
from draftsmith.train.corpus.tokens import collate
from draftsmith.train.loop import prepare_datasets


class Renders:
    """Counts the conversations rendered (one call of ``tokens.render`` each), in whichever process
    ``datasets.map`` runs them: each call adds a byte to a file."""

    def __init__(self, path):
        self.path = path
        path.write_bytes(b"")

    def __len__(self) -> int:
        return self.path.stat().st_size


@pytest.fixture
def renders(monkeypatch, tmp_path) -> Renders:
    counter = Renders(tmp_path / "renders")
    real = tokens.render

    def counted(*args, **kwargs):
        with counter.path.open("ab") as f:
            f.write(b".")
        return real(*args, **kwargs)

    monkeypatch.setattr(tokens, "render", counted)
    return counter


def build_with(paths, tokenizer, max_length=48, pack=False):
    return lambda: tokens.build_dataset(paths, tokenizer, max_length, pack=pack, seed=0)


def load(root, paths, tokenizer, max_length=48, pack=False, rank=0):
    settings = {"max_length": max_length, "pack": pack, "seed": 0}
    return cached_dataset(
        root, paths, tokenizer, settings, build_with(paths, tokenizer, max_length, pack), rank=rank
    )


def test_a_restart_renders_nothing_and_trains_on_the_same_rows(conversations, tmp_path, renders, capsys):  # noqa: F811
    config = make_config("unused", conversations, tmp_path / "run", "--data.pack=true")
    first_train, first_heldout = prepare_datasets(config, tiny_tokenizer())
    assert len(renders) == 24  # every conversation once
    assert "rendered into the dataset cache" in capsys.readouterr().out
    again_train, again_heldout = prepare_datasets(config, tiny_tokenizer())
    assert len(renders) == 24  # none more
    assert "read from the dataset cache" in capsys.readouterr().out
    assert (
        again_train.to_list() == first_train.to_list() and again_heldout.to_list() == first_heldout.to_list()
    )
    assert [p.name for p in (tmp_path / "run" / "dataset_cache").iterdir() if p.name.startswith(".")] == []


def test_rows_from_the_cache_equal_a_fresh_render(conversations, tmp_path):  # noqa: F811
    tok = tiny_tokenizer()
    for pack in (False, True):
        cached = load(tmp_path / "cache", [conversations], tok, pack=pack)
        assert cached.to_list() == build_with([conversations], tok, pack=pack)().to_list()


def test_the_cache_stores_a_token_in_nine_bytes_not_twenty_four(conversations, tmp_path):  # noqa: F811
    """Token ids and positions as int32 and the mask as int8, where Arrow's default for Python ints is int64:
    at 8B-70B scale a billion training tokens are 9 GB of cache instead of 24."""
    tok = tiny_tokenizer()
    widths = {"input_ids": "int32", "loss_mask": "int8", "position_ids": "int32"}
    for pack, columns in ((False, ("input_ids", "loss_mask")), (True, tuple(widths))):
        rows = load(tmp_path / "cache", [conversations], tok, pack=pack)
        assert {name: rows.features[name].feature.dtype for name in columns} == {
            c: widths[c] for c in columns
        }
        assert collate([rows[0]], pad_id=0).input_ids.dtype == torch.long  # widened where the model reads it


def test_a_changed_setting_template_or_data_is_a_new_entry(conversations, tmp_path, renders):  # noqa: F811
    root, tok = tmp_path / "cache", tiny_tokenizer()
    data = tmp_path / "convs.jsonl"
    data.write_text(conversations.read_text())
    load(root, [data], tok)
    assert len(renders) == 24
    load(root, [data], tok, max_length=40)  # another setting
    assert len(renders) == 48
    load(root, [data], tiny_tokenizer(CHATML + "{# another template #}"))  # another chat template
    assert len(renders) == 72
    with data.open("a") as f:  # the data grew
        f.write(
            json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})
            + "\n"
        )
    grown = load(root, [data], tok)
    assert len(renders) == 72 + 25 and len(grown) == 25
    load(root, [data], tok)  # and each of them is kept
    load(root, [data], tok, max_length=40)
    assert len(renders) == 72 + 25 + 25  # only the max_length=40 entry was of the old data
    assert len(list(root.iterdir())) == 5


DAMAGES = {
    "truncate": "does not match its SHA-256",
    "zeroed_in_place": "data-00000-of-00001.arrow does not match its SHA-256",
    "remove_state": "has lost state.json",
    "manifest_lies": "where 3 were written",
    "no_digests": "has no digests of its files",
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_entry_is_rebuilt(conversations, tmp_path, renders, capsys, damage):  # noqa: F811
    root, tok = tmp_path / "cache", tiny_tokenizer()
    whole = load(root, [conversations], tok).to_list()
    (entry,) = root.iterdir()
    (arrow,) = entry.glob("*.arrow")
    manifest = json.loads((entry / "draftsmith_dataset.json").read_text())
    if damage == "truncate":  # a file cut short (a disk that filled, a copy interrupted)
        arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    elif damage == "zeroed_in_place":  # dd conv=notrunc: the same size, Arrow opens it, tokens read 0
        size = arrow.stat().st_size
        with arrow.open("r+b") as f:
            f.seek(size // 2)
            f.write(bytes(200))
        assert arrow.stat().st_size == size
    elif damage == "remove_state":
        (entry / "state.json").unlink()
    elif damage == "manifest_lies":
        (entry / "draftsmith_dataset.json").write_text(json.dumps({**manifest, "num_rows": 3}))
    else:
        del manifest["sha256"]
        (entry / "draftsmith_dataset.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    rebuilt = load(root, [conversations], tok)
    said = [line for line in capsys.readouterr().out.splitlines() if "building it again" in line]
    assert len(said) == 1 and DAMAGES[damage] in said[0], said
    assert len(renders) == 48 and rebuilt.to_list() == whole
    assert load(root, [conversations], tok).to_list() == whole and len(renders) == 48  # whole again
    assert [p.name for p in root.iterdir()] == [entry.name]  # nothing of the damaged one left beside it


def test_other_ranks_read_rank_zeros_entry_and_never_render(conversations, tmp_path, renders):  # noqa: F811
    root, tok = tmp_path / "cache", tiny_tokenizer()
    settings = {"max_length": 48, "pack": False, "seed": 0}
    with pytest.raises(TimeoutError, match="data.cache_dir"):  # rank 0 has not written it
        cached_dataset(
            root, [conversations], tok, settings, lambda: pytest.fail("rank 1 built"), 1, wait_timeout=0.5
        )
    assert not root.exists() or not any(root.iterdir())
    rows = load(root, [conversations], tok)
    assert len(renders) == 24
    other = cached_dataset(root, [conversations], tok, settings, lambda: pytest.fail("rank 1 built"), rank=1)
    assert other.to_list() == rows.to_list() and len(renders) == 24


def test_too_few_rows_stores_nothing(conversations, tmp_path):  # noqa: F811
    config = make_config("unused", conversations, tmp_path / "run", "--data.heldout=30")
    with pytest.raises(ValueError, match="lower data.heldout"):
        prepare_datasets(config, tiny_tokenizer())
    assert not (tmp_path / "run").exists()
