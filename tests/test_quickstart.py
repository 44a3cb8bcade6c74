"""The quickstart's own pieces (the whole run is the README's main command, minutes long)."""

from __future__ import annotations

import pytest

from draftsmith.cli import main
from draftsmith.quickstart import TRAIN_FILES
from draftsmith.train.regenerate import first_user_turns


def test_prompts_come_from_each_training_file_in_turn(shared_data):
    rows = first_user_turns([shared_data / "train" / name for name in TRAIN_FILES], 7)
    assert [r["id"].split(":")[0] for r in rows] == [*TRAIN_FILES, *TRAIN_FILES, TRAIN_FILES[0]]
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" for r in rows)


def test_help_explains_the_steps(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["quickstart", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "EAGLE-3" in out and "--regenerate N" in out and "--eval-prompts" in out


def test_missing_data_folder_is_a_clear_error(tmp_path, capsys):
    assert main(["quickstart", "--data", str(tmp_path), "--out", str(tmp_path / "run")]) == 2
    assert "pass --data" in capsys.readouterr().err


def test_a_finished_training_is_not_repeated(tmp_path):
    import json

    from draftsmith.quickstart import ROOT, training_finished
    from draftsmith.train.config import load_config

    recipe = ROOT / "configs" / "quickstart.yaml"
    max_steps = load_config(recipe).trainer.max_steps
    assert not training_finished(tmp_path, recipe, [])  # nothing trained yet
    (tmp_path / "draft").mkdir()
    state = tmp_path / "draft" / "train_state.json"
    state.write_text(json.dumps({"step": max_steps // 2}))  # exported at a mid-run validation: resume it
    assert not training_finished(tmp_path, recipe, [])
    state.write_text(json.dumps({"step": max_steps}))
    assert training_finished(tmp_path, recipe, [])
    assert not training_finished(tmp_path, recipe, [f"--trainer.max_steps={max_steps + 40}"])
