"""The quickstart's own pieces (the whole run is the README's main command, minutes long)."""

from __future__ import annotations

import pytest

from draftsmith.cli import main
from draftsmith.sources import BUILTIN_TRAIN
from draftsmith.train.corpus.prompts import first_user_turns


def test_prompts_come_from_each_training_file_in_turn():
    rows = first_user_turns(list(BUILTIN_TRAIN), 7)
    names = ["sharegpt_1000.jsonl", "gsm8k_train.jsonl", "gpteacher_codegen.json"]  # ids as they always were
    assert [r["id"].split(":")[0] for r in rows] == [*names, *names, names[0]]
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" for r in rows)


def test_help_explains_the_steps(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["quickstart", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "EAGLE-3" in out and "--regenerate N" in out and "--eval-prompts" in out


def test_missing_data_is_a_clear_error_before_anything_runs(tmp_path, capsys):
    assert main(["quickstart", "--data", str(tmp_path / "mine.jsonl"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "mine.jsonl does not exist" in err and "builtin:sharegpt_1000" in err
    assert main(["quickstart", "--prompts", "builtin:dev_prompt", "--out", str(tmp_path / "run")]) == 2
    assert "did you mean builtin:dev_prompts?" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_finished_training_is_not_repeated(tmp_path):
    import json

    from draftsmith.quickstart import training_finished
    from draftsmith.train.config import load_config, resolve_recipe

    recipe = resolve_recipe("quickstart")
    max_steps = load_config(recipe).trainer.max_steps
    assert not training_finished(tmp_path, recipe, [])  # nothing trained yet
    (tmp_path / "draft").mkdir()
    state = tmp_path / "draft" / "train_state.json"
    state.write_text(json.dumps({"step": max_steps // 2}))  # exported at a mid-run validation: resume it
    assert not training_finished(tmp_path, recipe, [])
    state.write_text(json.dumps({"step": max_steps}))
    assert training_finished(tmp_path, recipe, [])
    assert not training_finished(tmp_path, recipe, [f"--trainer.max_steps={max_steps + 40}"])


def test_publish_finds_the_report_of_the_quickstart_eval(tmp_path, monkeypatch):
    """The quickstart's next step works: `draftsmith publish RUN` finds the eval report the quickstart wrote.

    The quickstart's own steps are recorded (not run); its eval step is then run for real on a tiny target
    with the same --draft and --out, as the quickstart passes them."""
    import json

    import torch
    from tiny import tiny_model, tiny_tokenizer

    from draftsmith.decode.target import Target
    from draftsmith.drafts.eagle import EagleConfig, EagleHead
    from draftsmith.train.config import load_config

    monkeypatch.chdir(tmp_path)
    prompts = [{"question_id": 1, "category": "chat", "turns": ["Tell me about cats."]}]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    model, tokenizer = tiny_model("llama", layers=8), tiny_tokenizer()
    model.save_pretrained("target")
    tokenizer.save_pretrained("target")
    run = tmp_path / "runs" / "quickstart" / "eagle3"
    torch.manual_seed(0)
    EagleHead(
        EagleConfig.for_target(Target(model, tokenizer, "target"), draft_vocab_size=64)
    ).save_pretrained(run / "draft")
    (run / "config.yaml").write_text("draft: {kind: eagle3}\n")
    max_steps = load_config("quickstart").trainer.max_steps
    (run / "draft" / "train_state.json").write_text(json.dumps({"step": max_steps}))  # trained: skipped
    steps = []
    monkeypatch.setattr("draftsmith.cli.main", lambda argv: steps.append(argv) or 0)
    assert main(["quickstart", "--prompts", "prompts.jsonl", "--out", "runs/quickstart"]) == 0
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    (eval_argv,) = [a for a in steps if a[0] == "eval"]
    draft, out = eval_argv[eval_argv.index("--draft") + 1], eval_argv[eval_argv.index("--out") + 1]
    tiny_eval = [
        "eval",
        "--target",
        "target",
        "--draft",
        draft,
        "--prompts",
        "prompts.jsonl",
    ]
    assert main([*tiny_eval, "--max-new-tokens", "8", "--k", "2", "--warmup", "0", "--out", out]) == 0
    publish = [
        "publish",
        "runs/quickstart/eagle3",
        "--repo-id",
        "me/head",
        "--base-model",
        "a/b",
        "--license",
        "mit",
    ]
    assert main([*publish, "--dry-run"]) == 0
