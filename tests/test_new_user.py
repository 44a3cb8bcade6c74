"""What a new user trips on, tried with tiny targets through the real entry points: prompts past the
context, failures found late, a run directory as --draft, silent overwrites, resumes of a changed
recipe, YAML typos, stale temporaries, and the small things (progress bar, warnings, JSON)."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
import torch
import yaml
from test_loop import QUIET, conversations, make_config, tiny_target_dir  # noqa: F401 (fixtures)
from tiny import tiny_target

from draftsmith.cli import main
from draftsmith.decode.batched import generate_batch
from draftsmith.decode.speculative import generate
from draftsmith.decode.tree import TreeSpec
from draftsmith.decode.tree_decode import generate_tree
from draftsmith.drafts import build_drafter
from draftsmith.train.config import load_config
from draftsmith.train.loop import train

UNWRITABLE = "/proc/draftsmith-cannot-write-here/out"
"""A folder nobody can create, root included (the tests may run as root, for whom mode bits do not bind)."""


def no_target_load(monkeypatch, *modules: str) -> None:
    for module in modules:
        monkeypatch.setattr(f"{module}.load_target", lambda *a, **k: pytest.fail("loaded a target first"))


@pytest.fixture
def long_prompts(tmp_path):
    """One prompt far longer than the tiny target's 512 positions, one short."""
    path = tmp_path / "prompts.jsonl"
    rows = [{"question_id": "long", "category": "x", "turns": ["word " * 200]},
            {"question_id": "short", "category": "x", "turns": ["hi"]}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def eval_argv(target_dir, prompts, out, *extra):
    return ["eval", "--target", str(target_dir), "--draft", "ngram", "--prompts", str(prompts),
            "--max-new-tokens", "8", "--warmup", "0", "--out", str(out), *extra]  # fmt: skip


def test_eval_refuses_a_prompt_past_the_context_and_truncates_only_when_asked(
    tiny_target_dir, long_prompts, tmp_path, capsys
):
    assert main(eval_argv(tiny_target_dir, long_prompts, tmp_path / "a")) == 2
    err = capsys.readouterr().err
    assert "more positions than the 512" in err and "long (up to" in err and "--truncate-prompts" in err
    assert not (tmp_path / "a" / "report.json").exists()
    assert main(eval_argv(tiny_target_dir, long_prompts, tmp_path / "b", "--truncate-prompts")) == 0
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    assert report["truncated_generations"] == 1 and report["settings"]["truncate_prompts"] is True
    assert "kept only its last tokens" in (tmp_path / "b" / "report.md").read_text()


def test_every_decoder_path_refuses_to_run_past_the_context():
    target = tiny_target("llama")
    ngram = build_drafter("ngram", target)
    fits, too_long = torch.arange(500) % 200, torch.arange(510) % 200
    assert len(generate(target, fits, ngram, 3, max_new_tokens=12).tokens) <= 12  # 512 exactly is fine
    for run in (
        lambda: generate(target, too_long, None, 0, max_new_tokens=8),
        lambda: generate(target, too_long, ngram, 3, max_new_tokens=8),
        lambda: generate_tree(target, too_long, ngram, TreeSpec(3, 2, 6), max_new_tokens=8),
        lambda: generate_batch(target, [fits[:10], too_long], ngram, k=3, max_new_tokens=8),
    ):
        with pytest.raises(ValueError, match="518 positions, more than the 512"):
            run()


def test_an_unwritable_out_is_found_before_any_model_loads(
    tiny_target_dir, long_prompts, monkeypatch, capsys
):
    no_target_load(monkeypatch, "draftsmith.decode.target")
    assert main(eval_argv(tiny_target_dir, long_prompts, UNWRITABLE)) == 2
    assert "cannot be written" in capsys.readouterr().err
    recipe = ["--data.paths=[x.jsonl]", f"--output.dir={UNWRITABLE}"]
    with pytest.raises(PermissionError, match="output.dir .* cannot be written"):
        train(load_config(None, recipe))


@pytest.mark.parametrize("bad", ["--draft.options={ttt_step: 2}", "--data.paths=[missing.jsonl]"])
def test_a_bad_recipe_fails_before_the_target_loads_and_leaves_nothing(
    tiny_target_dir,
    conversations,
    tmp_path,
    monkeypatch,
    bad,  # noqa: F811
):
    no_target_load(monkeypatch, "draftsmith.train.loop")
    config = make_config(tiny_target_dir, conversations, tmp_path / "run", "--draft.kind=eagle3", bad)
    with pytest.raises((ValueError, FileNotFoundError), match="ttt_steps|missing.jsonl"):
        train(config, **QUIET)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_eval_takes_a_run_directory_and_names_an_empty_one(tmp_path):
    from draftsmith.drafts.eagle import EagleConfig, EagleHead

    target = tiny_target("llama", layers=8)
    EagleHead(EagleConfig.for_target(target, draft_vocab_size=64)).save_pretrained(tmp_path / "run" / "draft")
    (tmp_path / "run" / "config.yaml").write_text("draft: {kind: eagle3}\n")
    assert build_drafter(str(tmp_path / "run"), target).capture_layers
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no draft.*draft/config.json"):
        build_drafter(str(tmp_path / "empty"), target)


def strict_json(text: str):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))


def test_a_finished_draft_is_never_replaced_unless_asked(
    tiny_target_dir, conversations, tmp_path, capsys, caplog
):  # noqa: F811
    out = tmp_path / "run"
    config = make_config(
        tiny_target_dir, conversations, out, "--trainer.max_steps=2", "--trainer.val_every=2"
    )
    with caplog.at_level(logging.INFO):
        train(config)  # with the progress bar a user sees
    shown = capsys.readouterr().err
    assert "train: 100%" in shown and "2/2" in shown and "Epoch" not in shown
    assert "weights_only" not in caplog.text
    state = strict_json((out / "draft" / "train_state.json").read_text())
    assert None in state.values()  # positions no chain reached: null, not a bare NaN
    shutil.rmtree(out / "checkpoints")  # a natural way to save space
    with pytest.raises(ValueError, match="holds a trained draft.*--overwrite"):
        train(config, **QUIET)
    assert strict_json((out / "draft" / "train_state.json").read_text()) == state
    assert train(config, overwrite=True, **QUIET).steps == 2


def test_train_overwrite_replaces_a_trained_draft_never_a_users_folder(
    tiny_target_dir, conversations, tmp_path
):  # noqa: F811
    """``draft/`` in an output folder is replaced by --overwrite only when a run trained it (its
    train_state.json); a model folder of the user's there is refused, naming what it holds, before any load."""
    out = tmp_path / "run"
    (out / "draft").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (out / "draft" / name).write_text(f"my {name}")
    config = make_config(
        tiny_target_dir, conversations, out, "--trainer.max_steps=2", "--trainer.val_every=2"
    )
    said = (
        f"{out / 'draft'} is not a draft draftsmith trained: it holds config.json, model.safetensors, "
        "tokenizer.json (3 entries) and no train_state.json"
    )
    with pytest.raises(ValueError, match=re.escape(said)):
        train(config, overwrite=True, target="never loaded", **QUIET)
    assert {p.name: p.read_text() for p in (out / "draft").iterdir()} == {
        n: f"my {n}" for n in ("config.json", "model.safetensors", "tokenizer.json")
    }
    assert sorted(p.name for p in out.iterdir()) == ["draft"]


def test_a_resume_with_a_changed_recipe_is_refused_unless_safe_or_forced(
    tiny_target_dir, conversations, tmp_path
):  # noqa: F811
    out = tmp_path / "run"
    base = ("--trainer.max_steps=2", "--trainer.ckpt_every=1", "--trainer.val_every=2")
    train(make_config(tiny_target_dir, conversations, out, *base), **QUIET)
    for change, key in (("--trainer.batch_size=2", "trainer.batch_size: 4 -> 2"),
                        (f"--data.paths=[{conversations}, {conversations}]", "data.paths")):  # fmt: skip
        with pytest.raises(ValueError, match=f"another recipe.*{key}.*--force-resume"):
            train(make_config(tiny_target_dir, conversations, out, *base, change), resume=True, **QUIET)
    history = out / "recipe_history.jsonl"
    assert not history.exists()
    longer = make_config(tiny_target_dir, conversations, out, *base, "--trainer.max_steps=3")
    assert train(longer, resume=True, **QUIET).steps == 3
    forced = make_config(
        tiny_target_dir, conversations, out, *base, "--trainer.max_steps=4", "--optim.lr=0.05"
    )
    assert train(forced, resume=True, force_resume=True, **QUIET).steps == 4
    entries = [json.loads(line) for line in history.read_text().splitlines()]
    assert entries[0]["changes"]["trainer.max_steps"] == {"was": 2, "now": 3} and not entries[0]["forced"]
    assert entries[1]["changes"]["optim.lr"] == {"was": 0.1, "now": 0.05} and entries[1]["forced"]
    assert "lr: 0.05" in (out / "config.yaml").read_text()


def test_a_run_recorded_before_keys_were_added_resumes_after_an_upgrade(
    tiny_target_dir, conversations, tmp_path
):  # noqa: F811
    """A key this version added (its default taken) is no recipe change: the run's config.yaml, written by an
    older draftsmith, lacks it."""
    out = tmp_path / "run"
    base = ("--trainer.max_steps=2", "--trainer.ckpt_every=1", "--trainer.val_every=2")
    train(make_config(tiny_target_dir, conversations, out, *base), **QUIET)
    recorded = yaml.safe_load((out / "config.yaml").read_text())
    for section, key in (("target", "shard"), ("data", "template_args"), ("trainer", "loggers")):
        del recorded[section][key]  # not None by default: an older run read as None would differ
    (out / "config.yaml").write_text(yaml.safe_dump(recorded, sort_keys=False))
    longer = make_config(tiny_target_dir, conversations, out, *base, "--trainer.max_steps=3")
    assert train(longer, resume=True, **QUIET).steps == 3


def test_yaml_mistakes_name_the_file_line_and_fix(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("target:\n  spec: x\ntrainer:\n  max_steps: [3\n  batch_size: 2\n")
    with pytest.raises(ValueError, match=r"recipe\.yaml:\d+:\d+: the recipe is not valid YAML") as info:
        load_config(recipe)
    assert "<unicode string>" not in str(info.value) and "close every [" in str(info.value)
    with pytest.raises(
        ValueError, match=r"override --data.paths=\[: the value is not valid YAML.*\[a.jsonl, b.jsonl\]"
    ):
        load_config(None, ["--data.paths=["])


def test_stale_temporaries_of_a_killed_export_are_removed(tiny_target_dir, conversations, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    for name in (".draft.tmp-a1", ".draft.tmp-b2", ".draft.old-c3"):
        (out / name).mkdir(parents=True)
        (out / name / "model.safetensors").write_bytes(b"half")
    train(
        make_config(tiny_target_dir, conversations, out, "--trainer.max_steps=1", "--trainer.val_every=1"),
        **QUIET,
    )
    assert not [p.name for p in out.iterdir() if p.name.startswith(".draft.")]


def test_malformed_json_is_described_in_whole_sentences(tmp_path):
    from draftsmith.train.corpus.conversations import load_conversations

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "a"}\n{"question": "tab\there", "answer": "a"}\n')
    with pytest.raises(
        ValueError, match=r"bad\.jsonl:2: malformed JSON .*raw control character .* at column 18"
    ):
        load_conversations([bad])
    bad.write_text('{"question": "q", "answer": "cut sho\n')
    with pytest.raises(ValueError, match="never ends.*at column 29"):
        load_conversations([bad])
