"""The chat data people have: reasoning replies, tool calls, system prompts, content in parts.

The templates here are written for the tests and behave as the real ones do: ``QWEN3_LIKE`` strips the
thinking of earlier assistant turns, keeps the last one's and opens an empty thinking block when
``enable_thinking`` is false (Qwen3's); ``LLAMA31_LIKE`` renders a system header, tool calls as JSON and tool
results under an ``ipython`` header (Llama-3.1's).
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file
from test_regenerate import data, target, target_dir  # noqa: F401 (the tiny target and its conversations)
from test_served import FakeServer
from tiny import tiny_tokenizer, train_debug_recipe

from draftsmith.cli import build_parser, main
from draftsmith.train.config import load_config
from draftsmith.train.corpus.conversations import load_conversations, restored
from draftsmith.train.corpus.regenerate import Dialogue, strip_thinking
from draftsmith.train.corpus.served import errors_path
from draftsmith.train.corpus.tokens import build_dataset, chat_text, render
from draftsmith.train.loop import TOKEN_COUNTS, prepare_datasets

QWEN3_LIKE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or m.role == 'system' %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{ '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}"
    "{%- else %}{{ '<|im_start|>assistant\n' + content }}{%- endif %}"
    "{%- for c in m.tool_calls or [] %}"
    "{{ '\n<tool_call>\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' + c.function.arguments | tojson + '}\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\n' }}"
    "{%- elif m.role == 'tool' %}{{ '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)

LLAMA31_LIKE = (
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n\n' + system + '<|eot_id|>' }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{%- set call = m.tool_calls[0].function %}"
    '{{ \'<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "\' + call.name + \'", "parameters": \' }}'
    "{{ call.arguments | tojson }}{{ '}<|eot_id|>' }}"
    "{%- elif m.role == 'tool' or m.role == 'ipython' %}"
    "{{ '<|start_header_id|>ipython<|end_header_id|>\n\n' + m.content + '<|eot_id|>' }}"
    "{%- else %}{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)

U1 = {"role": "user", "content": "What is 2+2?"}
U2 = {"role": "user", "content": "And times 3?"}
THINKING_1 = {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4."}
THINKING_2 = {"role": "assistant", "content": "<think>Multiply.</think>12."}


def qwen3_like():
    return tiny_tokenizer(QWEN3_LIKE)


def llama31_like():
    tokenizer = tiny_tokenizer(LLAMA31_LIKE)
    tokenizer.add_tokens(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], special_tokens=True)
    return tokenizer


def masked_text(tokenizer, row) -> list[str]:
    """The masked tokens of a row, decoded run by run."""
    runs, current = [], []
    for token, bit in zip(row["input_ids"], row["loss_mask"]):
        if bit:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return [tokenizer.decode(run) for run in runs + ([current] if current else [])]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# --- reasoning -----------------------------------------------------------------------------------


def test_thinking_turns_train_on_what_the_target_generated_each_in_its_own_context():
    """Earlier replies' thinking is stripped in context, so the whole conversation trains its last reply
    and each earlier reply gets a row of the conversation through it, thinking included."""
    tok = qwen3_like()
    messages = [U1, THINKING_1, U2, THINKING_2]
    whole, first = render(messages, tok, 10_000)
    assert tok.decode(whole["input_ids"]) == chat_text(tok, messages)
    assert "<|im_start|>assistant\n4.<|im_end|>" in tok.decode(whole["input_ids"])  # as the template has it
    assert masked_text(tok, whole) == ["<think>\nMultiply.\n</think>\n\n12.<|im_end|>"]
    assert tok.decode(first["input_ids"]) == chat_text(tok, messages[:2])
    assert masked_text(tok, first) == ["<think>\nAdd them.\n</think>\n\n4.<|im_end|>"]
    # a reply cut at max_new_tokens learns no end of turn, in its own row too
    _, cut_first = render(messages, tok, 10_000, cut_replies=[1])
    assert masked_text(tok, cut_first) == ["<think>\nAdd them.\n</think>\n\n4."]


def test_thinking_disabled_by_a_template_argument():
    tok = qwen3_like()
    plain = [U1, {"role": "assistant", "content": "4."}, U2, {"role": "assistant", "content": "12."}]
    args = {"enable_thinking": False}
    rows = render(plain, tok, 10_000, template_args=args)
    assert [masked_text(tok, row) for row in rows] == [["12.<|im_end|>"], ["4.<|im_end|>"]]
    assert "<think>\n\n</think>\n\n4." in tok.decode(rows[1]["input_ids"])  # what the target saw


def test_a_turn_the_template_renders_apart_from_its_prompt_is_refused_showing_both():
    """Thinking replies rendered with thinking disabled: the prompt ends in an empty thinking block that the
    rendered turn does not continue, so no reply start can be found."""
    with pytest.raises(ValueError) as err:
        render([U1, THINKING_1], qwen3_like(), 10_000, template_args={"enable_thinking": False})
    text = str(err.value)
    assert text.startswith("turn 1 (assistant)")
    assert "<think>\\n\\n</think>" in text and "Add them." in text  # both renderings shown
    assert "enable_thinking" in text


def test_thinking_data_builds_a_dataset_from_a_file(tmp_path):
    path = write_jsonl(tmp_path / "think.jsonl", [{"messages": [U1, THINKING_1, U2, THINKING_2]}] * 3)
    tok = qwen3_like()
    rows = build_dataset([path], tok, 10_000)
    assert len(rows) == 6
    assert (
        sorted(masked_text(tok, row)[0][:12] for row in rows) == ["<think>\nAdd "] * 3 + ["<think>\nMult"] * 3
    )


def test_strip_thinking():
    assert strip_thinking("<think>\nhmm\n</think>\n\nThe answer.") == "The answer."
    assert strip_thinking("hmm, opened by the prompt\n</think>\n\nThe answer.") == "The answer."
    assert strip_thinking("<think>\nstill thinking when cut") == ""
    assert strip_thinking("No thinking here.") == "No thinking here."
    assert strip_thinking("Write <think> then </think>.") == "Write <think> then </think>."


@pytest.mark.parametrize(("reasoning", "saved"), [("keep", "<think>\nhm\n</think>\n\n4."), ("strip", "4.")])
def test_dialogue_saves_thinking_as_asked_and_flags_a_reply_cut_inside_it(reasoning, saved):
    dialogue = Dialogue("a:0", [U1, THINKING_1, U2, THINKING_2], reasoning=reasoning, system="Be brief.")
    assert [m["role"] for m in dialogue.next_prompt()] == ["system", "user"]
    dialogue.answer("<think>\nhm\n</think>\n\n4.", finished=True)
    dialogue.next_prompt()
    dialogue.answer("<think>\nlong thoughts, cut", finished=False)
    assert dialogue.next_prompt() is None
    record = dialogue.record()
    assert record["messages"][2]["content"] == saved
    assert record["cut_replies"] == [4] and record["cut_thinking"] == [4]
    assert record["messages"][4]["content"] == ("" if reasoning == "strip" else "<think>\nlong thoughts, cut")


def test_dialogue_passes_template_args_to_the_prompt():
    tok = qwen3_like()
    ids = Dialogue("a:0", [U1], template_args={"enable_thinking": False}).next_ids(tok, None)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


# --- tools, parts, system ------------------------------------------------------------------------

TOOL_CONVERSATION = {
    "messages": [
        {"role": "system", "content": "You can call get_weather."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "sunny"}'},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "Thanks. Ask the other tools too."},
        {"role": "function", "content": "rain later"},
        {"role": "ipython", "content": "22C"},
        {"role": "assistant", "content": "Rain later, 22C."},
    ]
}


def test_tool_messages_are_context_and_tool_calls_are_trained_as_the_template_renders_them(tmp_path):
    path = write_jsonl(tmp_path / "tools.jsonl", [TOOL_CONVERSATION] * 3)
    loaded = load_conversations([path])
    messages = loaded[0]["messages"]
    assert [m["role"] for m in messages] == [
        "system", "user", "assistant", "tool", "assistant", "user", "tool", "tool", "assistant",
    ]  # fmt: skip
    assert messages[1]["content"] == "Weather in Paris?"
    tok = llama31_like()
    rows = build_dataset([path], tok, 10_000)
    assert len(rows) == 3
    assert (
        masked_text(tok, rows[0])
        == [
            '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',  # arguments an object, not quoted
            "It is sunny.<|eot_id|>",
            "Rain later, 22C.<|eot_id|>",
        ]
    )
    text = tok.decode(rows[0]["input_ids"])
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"sky": "sunny"}<|eot_id|>' in text
    assert "You can call get_weather." in text


def test_tool_call_turns_a_template_drops_are_context_only_and_counted(tmp_path, caplog):
    """SmolLM2's template (the tiny tokenizer's ChatML) drops tool_calls: the call turn renders as a bare
    end-of-turn, which the target never wrote after that prompt; it is not trained on, and the log says how
    many such turns there were and how to train on them."""
    path = write_jsonl(tmp_path / "tools.jsonl", [TOOL_CONVERSATION] * 3)
    tok = tiny_tokenizer()
    messages = restored(load_conversations([path])[0])
    assert chat_text(tok, messages[:3]).endswith("<|im_start|>assistant\n<|im_end|>\n")  # the call dropped
    uncalled = []
    (row,) = render(messages, tok, 10_000, uncalled=uncalled)
    assert uncalled == [2]
    assert masked_text(tok, row) == ["It is sunny.<|im_end|>", "Rain later, 22C.<|im_end|>"]
    with caplog.at_level("WARNING", logger="draftsmith.train.corpus.tokens"):
        rows = build_dataset([path], tok, 10_000)
    assert [masked_text(tok, r) for r in rows] == [masked_text(tok, row)] * 3
    assert "3 assistant turns with tool calls are context only" in caplog.text
    assert "--target.chat_template" in caplog.text
    # a template that renders the call trains on it, and says nothing
    caplog.clear()
    uncalled = []
    render(messages, llama31_like(), 10_000, uncalled=uncalled)
    assert uncalled == []


def test_a_system_prompt_is_put_first_where_there_is_none(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [U1, {"role": "assistant", "content": "4."}]},
                                                 {"messages": [{"role": "system", "content": "Own."}, U2,
                                                               {"role": "assistant", "content": "6."}]}])  # fmt: skip
    tok = llama31_like()
    texts = [tok.decode(r["input_ids"]) for r in build_dataset([path], tok, 10_000, system="Be brief.")]
    lacking = next(t for t in texts if "What is 2+2?" in t)
    own = next(t for t in texts if "And times 3?" in t)
    assert "Be brief.<|eot_id|>" in lacking
    assert "Own.<|eot_id|>" in own and "Be brief." not in own


@pytest.mark.parametrize(
    ("turn", "match"),
    [
        (
            {"role": "narrator", "content": "x"},
            r"record 0 \(line 1\), turn 1: unknown role 'narrator'; known roles: .*ipython",
        ),
        (
            {
                "role": "user",
                "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {}}],
            },
            r"record 0 \(line 1\), turn 1: content part 1 is of type 'image_url'; only text parts",
        ),
        (
            {"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
            "turn 1: a 'user' message has tool_calls",
        ),
        (
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
            "turn 1: tool call 0 has no function name",
        ),
    ],
)
def test_chat_data_refusals_name_the_record_and_what_is_wrong(tmp_path, turn, match):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": [U1, turn]}])
    with pytest.raises(ValueError, match=match):
        load_conversations([path])


# --- regenerate through a server, and the training config ------------------------------------------


class ThinkingServer(FakeServer):
    """Answers every prompt with a reply that thinks first, and keeps the prompts it was sent."""

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        self.prompts: list[str] = []

    def complete(self, body: dict) -> dict:
        self.prompts.append(self.tokenizer.decode(body["prompt"]))
        return {"choices": [{"text": "<think>\nhm\n</think>\n\nok", "finish_reason": "stop"}],
                "usage": {"completion_tokens": 9}}  # fmt: skip


def test_cli_regenerate_strips_thinking_puts_the_system_prompt_first_and_passes_template_args(
    target, target_dir, data, tmp_path
):
    template = tmp_path / "qwen3.jinja"
    template.write_text(QWEN3_LIKE)
    out = tmp_path / "regen.jsonl"
    server = ThinkingServer(*target)
    try:
        assert main(["data", "regenerate", "--target", str(target_dir), "--data", str(data), "--out", str(out),
                     "--server", server.url, "--chat-template", str(template), "--reasoning", "strip",
                     "--system", "Be brief.", "--template-arg", "enable_thinking=false", "--limit", "2"]) == 0  # fmt: skip
    finally:
        server.close()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["messages"][0] == {"role": "system", "content": "Be brief."}
        assert [m["content"] for m in row["messages"] if m["role"] == "assistant"] == ["ok"]
    assert len(server.prompts) == 2
    assert all(p.startswith("<|im_start|>system\nBe brief.") for p in server.prompts)
    assert all(p.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for p in server.prompts)


def test_template_arg_refuses_what_is_not_key_value(capsys):
    with pytest.raises(SystemExit):
        build_parser("data").parse_args(["data", "regenerate", "--target", "t", "--data", "d", "--out", "o",
                                         "--template-arg", "enable_thinking"])  # fmt: skip
    assert "expected KEY=VALUE, e.g. enable_thinking=false" in capsys.readouterr().err


def test_a_refused_request_goes_to_the_errors_file_and_the_job_goes_on(
    target, target_dir, data, tmp_path, capsys
):
    out = tmp_path / "regen.jsonl"
    server = FakeServer(*target)
    server.refuse = lambda prompt: "prompt too long for this server" if "3+3" in prompt else None
    argv = ["data", "regenerate", "--target", str(target_dir), "--data", str(data), "--out", str(out),
            "--server", server.url, "--max-new-tokens", "4"]  # fmt: skip
    try:
        assert main(argv) == 0
        printed = capsys.readouterr().out
        ids = [json.loads(line)["source_id"] for line in out.read_text().splitlines()]
        assert ids == [f"train.jsonl:{i}" for i in (0, 1, 2, 4, 5)]  # the rest in input order
        (refusal,) = [json.loads(line) for line in errors_path(out).read_text().splitlines()]
        assert refusal["source_id"] == "train.jsonl:3" and refusal["status"] == 400
        assert "prompt too long for this server" in refusal["reason"]
        assert (
            f"1 conversations the server refused (HTTP 4xx) are listed with the reasons in {errors_path(out)}"
            in printed
        )
        assert errors_path(out).name == "regen.jsonl.errors"  # no part-*.jsonl pattern takes it for data
        server.refuse = None  # a rerun tries the refused conversation again
        assert main(argv) == 0
        assert "wrote 1 conversations" in capsys.readouterr().out
    finally:
        server.close()


def test_data_template_args_and_system_in_the_training_config(tmp_path):
    path = write_jsonl(tmp_path / "plain.jsonl",
                       [{"messages": [U1, {"role": "assistant", "content": f"{i}."}]} for i in range(4)])  # fmt: skip
    config = load_config(overrides=[f"--data.paths={path}", "--data.heldout=1", "--data.system=Be brief.",
                                    "--data.template_args={enable_thinking: false}"])  # fmt: skip
    assert config.data.template_args == {"enable_thinking": False}
    train, heldout = prepare_datasets(config, qwen3_like())
    texts = [qwen3_like().decode(row["input_ids"]) for row in [*train, *heldout]]
    assert len(texts) == 4
    assert all(
        t.startswith("<|im_start|>system\nBe brief.") and "<think>\n\n</think>\n\n" in t for t in texts
    )


def test_multi_turn_thinking_and_tool_conversations_train(tmp_path):
    """EAGLE-3's debug recipe for 2 steps on a tiny target whose template strips earlier thinking."""
    template = tmp_path / "qwen3.jinja"
    template.write_text(QWEN3_LIKE)
    data = write_jsonl(
        tmp_path / "chat.jsonl",
        [{"messages": [U1, THINKING_1, U2, {"role": "assistant", "content": f"<think>x{i}</think>{i}."}]}
         for i in range(10)] + [TOOL_CONVERSATION] * 4,
    )  # fmt: skip
    result, _ = train_debug_recipe(
        tmp_path, "debug_eagle3.yaml", f"--data.paths=[{data}]", f"--target.chat_template={template}",
        "--data.heldout=4", layers=2,
    )  # fmt: skip
    # What it learnt is this file's, as this template renders it: the last turns' thinking ("x{i}") and
    # the tool call (get_weather), which the tiny tokenizer's own ChatML template does not render
    counts = load_file(str(result.output_dir / TOKEN_COUNTS))["token_counts"]
    learnt = {text: int(counts[tiny_tokenizer().convert_tokens_to_ids(text)]) for text in ("x", "_")}
    assert learnt["x"] > 0 and learnt["_"] > 0, learnt
