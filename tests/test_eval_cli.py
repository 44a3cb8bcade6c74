"""`draftsmith eval` end to end on a tiny saved model, plus the harness pieces it relies on."""

from __future__ import annotations

import json

import pytest
from tiny import tiny_model, tiny_target, tiny_tokenizer

import draftsmith.eval.harness as harness
from draftsmith.cli import main
from draftsmith.decode.sampling import Sampling
from draftsmith.drafts.ngram import NgramDrafter
from draftsmith.eval.harness import (
    GenerationSettings,
    Method,
    MethodResult,
    compare_outputs,
    evaluate,
    run_prompt,
)
from draftsmith.eval.prompts import EvalPrompt, answer_text

RECORDS = [
    {"question_id": 1, "category": "chat", "turns": ["Tell me about cats.", "And dogs?"]},
    {"question_id": 2, "category": "code", "turns": ["def add(a, b): return a + b  # add(add(1, 2), 3)"]},
    {"prompt": "abc abc abc abc", "category": "code"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    tiny_model("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture()
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return path


def budget_steps(max_new_tokens: int, k: int) -> list[int]:
    """Draft lengths per verify step when every draft is accepted and no EOS comes (the decoder's budget rule)."""
    done, steps = 1, []  # the prefill commits the first token
    while done < max_new_tokens:
        steps.append(min(k, max_new_tokens - done - 1))
        done += steps[-1] + 1
    return steps


def test_eval_end_to_end(model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("not ours")
    argv = [
        "eval",
        "--target",
        str(model_dir),
        "--draft",
        str(model_dir),
        "--draft",
        "ngram",
        "--draft",
        "layers:2",
    ]
    argv += ["--prompts", str(prompts_file), "--max-new-tokens", "12", "--k", "3", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "speedup" in printed and "layers:2" in printed and "report.json" in printed

    report = json.loads((out / "report.json").read_text())
    assert (out / "keep.txt").read_text() == "not ours"
    assert "| draft | category |" in (out / "report.md").read_text()
    png = (out / "acceptance.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and "acceptance.png" in (out / "report.md").read_text()
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    assert report["target"] == str(model_dir)
    settings = report["settings"]
    assert settings["k"] == 3 and settings["max_new_tokens"] == 12 and settings["temperature"] == 0.0
    assert settings["drafts"] == [str(model_dir), "ngram", "layers:2"] and settings["num_prompts"] == 3
    for key in (
        "top_k",
        "top_p",
        "seed",
        "device",
        "dtype",
        "warmup",
        "limit",
        "categories",
        "prompts",
        "out",
    ):
        assert key in settings
    assert "torch" in report["hardware"] and "cpu" in report["hardware"]
    base = report["baseline"]
    assert base["generations"] == 4  # 1 two-turn question + 2 single-turn prompts
    assert base["new_tokens"] > 0 and base["seconds"] > 0 and base["tokens_per_s"] > 0

    drafts = {d["name"]: d for d in report["drafts"]}
    assert list(drafts) == [str(model_dir), "ngram", "layers:2"]
    for d in drafts.values():
        assert d["exact_match"] is True and d["mismatched_prompts"] == []
        assert d["new_tokens"] == base["new_tokens"]
        assert set(d["categories"]) == {"chat", "code"}
        for cat in d["categories"].values():
            assert set(cat) >= {"tau", "alpha", "speedup"}
        assert d["speedup"] == pytest.approx(d["tokens_per_s"] / base["tokens_per_s"])
        for key in ("draft_seconds", "verify_seconds", "target_forwards", "per_position", "tau", "alpha"):
            assert key in d

    # the same model as its own draft: every token accepted, τ = k + 1 except where the budget runs out
    same = drafts[str(model_dir)]
    steps = budget_steps(12, 3)
    assert steps[0] == 3
    assert same["alpha"] == 1.0 and same["per_position"] == [1.0, 1.0, 1.0]
    assert same["tau"] == pytest.approx(sum(s + 1 for s in steps) / len(steps))
    assert same["acceptance"]["steps"] == [[p, p, 4 * steps.count(p)] for p in sorted(set(steps))]


def test_help_explains_options_and_metrics(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = capsys.readouterr().out
    for needle in ("--max-new-tokens", "--warmup", "--categories", "layers:N", "τ", "α", "speedup", "turns"):
        assert needle in text


def test_eval_with_cost_model_k(model_dir, prompts_file, tmp_path):
    out = tmp_path / "auto"
    argv = ["eval", "--target", str(model_dir), "--draft", str(model_dir), "--draft", "ngram"]
    argv += ["--prompts", str(prompts_file), "--max-new-tokens", "16", "--k", "auto", "--k-max", "4"]
    assert main([*argv, "--cpu-kernels", "stock", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["k"] == "auto" and report["settings"]["cpu_kernels"] == "stock"
    for d in report["drafts"]:
        assert d["exact_match"] is True
        chosen = {int(k): n for k, n in d["chosen_k"].items()}
        assert set(chosen) <= set(range(5))
        assert sum(chosen.values()) == sum(n for _, _, n in d["acceptance"]["steps"])
    assert "chosen online" in (out / "report.md").read_text()


def test_eval_with_int8_draft_weights(model_dir, prompts_file, tmp_path):
    """The target's own weights as a separate draft, quantized: output still exact, acceptance high."""
    out = tmp_path / "int8"
    argv = ["eval", "--target", str(model_dir), "--draft", str(model_dir), "--prompts", str(prompts_file)]
    assert (
        main([*argv, "--max-new-tokens", "16", "--k", "3", "--draft-weights", "int8", "--out", str(out)]) == 0
    )
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["draft_weights"] == "int8"
    (draft,) = report["drafts"]
    assert draft["exact_match"] is True and draft["tau"] > 2.0


def test_k_must_be_a_number_or_auto(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--target", "t", "--draft", "ngram", "--prompts", "p", "--out", "o", "--k", "many"])
    assert "--k takes an integer >= 1 or 'auto', got 'many'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, content, complaint",
    [
        ([], '{"prompt": "ok"}\n{"prompt": \n', "prompts.jsonl:2: malformed JSON"),
        ([], '{"text": "hi"}\n', "no usable field"),
        ([], "", "is empty"),
        (["--draft", "ngram"], '{"prompt": "ok"}\n', "given more than once"),
        (["--k", "0"], '{"prompt": "ok"}\n', "--k must be at least 1"),
        (["--categories", "nope"], '{"prompt": "ok"}\n', "do not occur"),
        (["--temperature", "-1"], '{"prompt": "ok"}\n', "temperature must be >= 0"),
    ],
)
def test_bad_inputs_exit_2_with_message(tmp_path, capsys, extra, content, complaint):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    argv = [
        "eval",
        "--target",
        "unused",
        "--draft",
        "ngram",
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "o"),
    ]
    assert main(argv + extra) == 2
    assert complaint in capsys.readouterr().err


def test_missing_prompt_file_and_bad_draft(model_dir, tmp_path, capsys):
    argv = ["eval", "--target", str(model_dir), "--out", str(tmp_path / "o")]
    assert main([*argv, "--draft", "ngram", "--prompts", str(tmp_path / "none.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ok"}\n')
    assert main([*argv, "--draft", "layers:x", "--prompts", str(prompts)]) == 2
    assert "layers:8" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


def test_second_turn_continues_with_own_answer(target, monkeypatch):
    seen = []

    def spy(target_, prompt, *args, **kwargs):
        seen.append(target_.tokenizer.decode(prompt.tolist()))
        return real(target_, prompt, *args, **kwargs)

    real = harness.generate
    monkeypatch.setattr(harness, "generate", spy)
    prompt = EvalPrompt("q", "chat", ("first question", "second question"))
    method, run = (
        Method("ngram", NgramDrafter(), k=3),
        GenerationSettings(max_new_tokens=8, sampling=Sampling()),
    )
    outputs, stats = run_prompt(target, method, prompt, run)
    assert len(outputs) == 2 and stats.timing.generations == 2
    assert seen[1].startswith(seen[0])  # the whole first exchange, then the new turn
    answer = answer_text(target.tokenizer, outputs[0])
    assert seen[1] == seen[0] + answer + "<|im_end|>\n<|im_start|>user\nsecond question<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )


def test_sampled_runs_are_reproducible_and_not_compared(target):
    prompts = [EvalPrompt("a", "x", ("hello hello hello",)), EvalPrompt("b", "y", ("some text",))]
    sampling = Sampling(temperature=1.0)
    runs = [
        evaluate(
            target, [("ngram", NgramDrafter())], prompts, k=3, max_new_tokens=10, sampling=sampling, seed=s
        )
        for s in (7, 7, 8)
    ]
    assert runs[0].drafts[0].exact_match is None and runs[0].greedy is False
    assert runs[0].baseline.outputs == runs[1].baseline.outputs
    assert runs[0].drafts[0].outputs == runs[1].drafts[0].outputs
    assert runs[0].baseline.outputs != runs[2].baseline.outputs  # the seed matters


def test_compare_outputs_flags_mismatches():
    prompts = [EvalPrompt("a", "x", ("p",)), EvalPrompt("b", "y", ("p",))]
    base, draft = MethodResult("base"), MethodResult("d")
    base.outputs = [[[1, 2, 3]], [[4, 5]]]
    draft.outputs = [[[1, 2, 3]], [[4, 6]]]
    compare_outputs(base, draft, prompts)
    assert draft.exact_match is False and draft.mismatched_prompts == ["b"]
    assert draft.category_exact == {"x": True, "y": False}


def test_an_earlier_report_is_replaced_only_with_overwrite(model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "report.json").write_text('{"mine": true}\n')
    (out / "notes.txt").write_text("kept\n")
    argv = ["eval", "--target", str(model_dir), "--draft", "ngram", "--prompts", str(prompts_file)]
    argv += ["--max-new-tokens", "8", "--warmup", "0", "--out", str(out)]
    assert main(argv) == 2
    assert "already holds report.json of an earlier eval; pass --overwrite" in capsys.readouterr().err
    assert json.loads((out / "report.json").read_text()) == {"mine": True}
    assert main([*argv, "--overwrite"]) == 0
    assert "drafts" in json.loads((out / "report.json").read_text())
    assert (out / "notes.txt").read_text() == "kept\n"  # other files in the folder are left alone


def test_eagle1_and_eagle3_heads_show_their_kind_in_reports(target, tmp_path):
    from draftsmith.drafts import build_drafter
    from draftsmith.drafts.eagle import EagleConfig, EagleHead

    names = []
    for preset in ("eagle1", "eagle3"):
        EagleHead(EagleConfig.for_target(target, preset, draft_vocab_size=120)).save_pretrained(
            tmp_path / preset
        )
        names.append(build_drafter(str(tmp_path / preset), target).name)
    assert names == ["eagle1:eagle1", "eagle3:eagle3"]
