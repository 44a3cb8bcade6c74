"""``draftsmith data regenerate --server``: replies from OpenAI-compatible servers, checked and resumable.

The server here is a real HTTP server on 127.0.0.1 that answers ``/v1/models``, ``/tokenize`` and
``/v1/completions`` from token ids with the tiny target's own greedy ``generate``, so the served path must
write exactly what the in-process path writes. Faults (a server for another model, one that dies mid-run,
one that answers nonsense) are switches on it.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from test_regenerate import data, target, target_dir  # noqa: F401 (the same tiny target and conversations)
from tiny import tiny_bpe_tokenizer

from draftsmith.cli import main
from draftsmith.loading import eos_token_ids
from draftsmith.openai_client import CompletionServer, ServerError, check_server
from draftsmith.sources import DataSourceError, expand_sources
from draftsmith.train.corpus.conversations import load_conversations
from draftsmith.train.corpus.prompts import parse_shard, take_shard
from draftsmith.train.corpus.regenerate import regenerate
from draftsmith.train.corpus.served import regenerate_served

MAX_NEW = 6


class FakeServer:
    """An OpenAI-compatible completions server backed by ``model`` (greedy), with fault switches."""

    def __init__(self, model, tokenizer, probe_tokenizer=None, n_vocab=None):
        self.model, self.tokenizer = model, tokenizer
        self.probe_tokenizer = (
            probe_tokenizer or tokenizer
        )  # what /tokenize uses (another model's, for a mismatch)
        self.n_vocab = n_vocab or model.config.vocab_size
        self.die_after: int | None = None  # completions answered before it starts failing with HTTP 503
        self.malformed = False
        self.refuse = None  # prompt text -> the reason to answer HTTP 400 with, or None to answer
        self.completions = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, code: int, body) -> None:
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    return self.reply(200, {"data": [{"id": "tiny", "meta": {"n_vocab": outer.n_vocab}}]})
                self.reply(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    ids = outer.probe_tokenizer(body["content"], add_special_tokens=False)["input_ids"]
                    return self.reply(200, {"tokens": ids})
                if self.path != "/v1/completions":
                    return self.reply(404, {"error": "not found"})
                reason = outer.refuse and outer.refuse(outer.tokenizer.decode(body["prompt"]))
                if reason:
                    return self.reply(400, {"error": {"message": reason}})
                with outer.lock:
                    outer.completions += 1
                    if outer.die_after is not None and outer.completions > outer.die_after:
                        return self.reply(503, {"error": "loading model"})
                    if outer.malformed:
                        return self.reply(200, {"choices": []})
                    self.reply(200, outer.complete(body))

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    @torch.inference_mode()
    def complete(self, body: dict) -> dict:
        ids = torch.tensor([body["prompt"]])
        eos = sorted(eos_token_ids(self.model, self.tokenizer))
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=body["max_tokens"],
                                  do_sample=False, eos_token_id=eos, pad_token_id=eos[0])[0, ids.shape[1]:].tolist()  # fmt: skip
        end = next((i for i, t in enumerate(out) if t in eos), None)
        stopped = end is not None
        reply = out[:end] if stopped else out
        return {"choices": [{"text": self.tokenizer.decode(reply, skip_special_tokens=True),
                             "finish_reason": "stop" if stopped else "length"}],
                "usage": {"completion_tokens": len(reply) + stopped}}  # fmt: skip

    def close(self):
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def server(target):
    fake = FakeServer(*target)
    yield fake
    fake.close()


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def served(target, data, out, urls, **kw):
    _, tokenizer = target
    servers = [CompletionServer(url, retries=kw.pop("retries", 5), backoff=0.01) for url in urls]
    return regenerate_served(
        tokenizer, [data], out, servers, 259, max_new_tokens=MAX_NEW, progress=False, **kw
    )


def test_served_replies_equal_the_in_process_ones_in_input_order(target, server, data, tmp_path):
    model, tokenizer = target
    ours = tmp_path / "ours.jsonl"
    regenerate(model, tokenizer, [data], ours, max_new_tokens=MAX_NEW, batch_size=1, progress=False)
    out = tmp_path / "served.jsonl"
    stats = served(target, data, out, [server.url, server.url], in_flight=3)  # two "replicas", 6 in flight
    rows = lines(out)
    assert [r["source_id"] for r in rows] == [f"train.jsonl:{i}" for i in range(6)]  # input order
    by_id = {r["source_id"]: r["messages"] for r in lines(ours)}
    assert all(r["messages"] == by_id[r["source_id"]] for r in rows)
    assert rows[0]["generator"]["model"] == "tiny" and stats.written == 6 and stats.replies == 7
    assert sum(r.get("truncated_replies", 0) for r in rows) == stats.truncated_replies


def test_a_server_for_another_model_is_refused_naming_the_first_differing_token(target, data, tmp_path):
    model, tokenizer = target
    other = FakeServer(model, tokenizer, probe_tokenizer=tiny_bpe_tokenizer())
    try:
        with pytest.raises(
            ServerError, match=r"tokenizes differently from the target: at token \d+ .* the server"
        ):
            served(target, data, tmp_path / "out.jsonl", [other.url])
        assert other.completions == 0 and not (tmp_path / "out.jsonl").exists()  # refused before any work
    finally:
        other.close()
    bigger = FakeServer(model, tokenizer, n_vocab=32000)
    try:
        with pytest.raises(ServerError, match="vocabulary of 32000 tokens, but the target has 259"):
            check_server(CompletionServer(bigger.url), tokenizer, 259)
    finally:
        bigger.close()


def test_a_server_that_dies_mid_run_stops_with_rows_kept_and_the_rerun_resumes(
    target, server, data, tmp_path
):
    out = tmp_path / "out.jsonl"
    server.die_after = 4
    with pytest.raises(
        ServerError,
        match=r"(?s)regeneration stopped: .*after 3 tries.*4 conversations were written.*rerun draftsmith data regenerate",
    ):
        served(target, data, out, [server.url], in_flight=1, retries=3,
               resume_hint="rerun draftsmith data regenerate ...")  # fmt: skip
    kept = lines(out)
    assert [r["source_id"] for r in kept] == [f"train.jsonl:{i}" for i in range(4)]  # retried, then stopped
    server.die_after = None
    stats = served(target, data, out, [server.url], in_flight=2)
    rows = lines(out)
    assert stats.already_done == 4 and stats.written == 2
    assert [r["source_id"] for r in rows] == [
        f"train.jsonl:{i}" for i in range(6)
    ]  # every row once, in order


def test_a_malformed_response_is_an_error_naming_the_server(target, server, data, tmp_path):
    server.malformed = True
    with pytest.raises(ServerError, match=r"/v1/completions answered without choices\[0\]\.text"):
        served(target, data, tmp_path / "out.jsonl", [server.url], in_flight=1)
    assert server.completions == 1  # a wrong answer is not retried


def test_an_unreachable_server_is_retried_then_refused(target, data, tmp_path):
    with pytest.raises(ServerError, match=r"did not answer /v1/models after 2 tries"):
        served(target, data, tmp_path / "out.jsonl", ["http://127.0.0.1:9"], retries=2)


def test_shards_are_disjoint_cover_the_input_and_train_as_one_set(target, server, data, tmp_path):
    assert parse_shard("2/4") == (2, 4)
    for bad in ("4/4", "-1/4", "1", "a/b", "0/0"):
        with pytest.raises(ValueError, match="--shard"):
            parse_shard(bad)
    items = list(range(10))
    assert sorted(sum((take_shard(items, (i, 3)) for i in range(3)), [])) == items
    for i in range(3):
        served(target, data, tmp_path / f"part-{i}.jsonl", [server.url], shard=(i, 3))
    ids = [r["source_id"] for i in range(3) for r in lines(tmp_path / f"part-{i}.jsonl")]
    assert sorted(ids) == sorted(f"train.jsonl:{i}" for i in range(6)) and len(set(ids)) == 6
    assert expand_sources([str(tmp_path / "part-*.jsonl")]) == [
        tmp_path / f"part-{i}.jsonl" for i in range(3)
    ]
    records = data.read_text().splitlines(keepends=True)  # the input split as the shards split it
    for i in range(3):
        (tmp_path / f"input-{i}.jsonl").write_text("".join(take_shard(records, (i, 3))))
    assert len(load_conversations([str(tmp_path / "input-*.jsonl")])) == len(load_conversations([data]))
    with pytest.raises(DataSourceError, match="matches no file"):
        expand_sources([str(tmp_path / "nothing-*.jsonl")])


def test_cli_server_engine(target_dir, server, data, tmp_path, capsys, monkeypatch):
    out = tmp_path / "cli.jsonl"
    assert main(["data", "regenerate", "--target", str(target_dir), "--data", str(data), "--out", str(out),
                 "--server", server.url, "--max-new-tokens", str(MAX_NEW), "--shard", "1/2"]) == 0  # fmt: skip
    rows = lines(out)
    assert [r["source_id"] for r in rows] == [f"train.jsonl:{i}" for i in range(1, 6, 2)]
    assert rows[0]["generator"] == {"engine": "server", "model": "tiny"}
    assert main(["data", "regenerate", "--target", str(target_dir), "--data", str(data), "--out", str(out),
                 "--engine", "server"]) == 2  # fmt: skip
    assert "--engine server needs at least one --server URL" in capsys.readouterr().err
    server.die_after = server.completions  # the CLI says how to resume, and exits non-zero
    monkeypatch.setattr("draftsmith.openai_client.time.sleep", lambda seconds: None)  # no backoff waits
    assert main(["data", "regenerate", "--target", str(target_dir), "--data", str(data), "--out", str(out),
                 "--server", server.url, "--max-new-tokens", str(MAX_NEW)]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "did not answer /v1/completions" in err and "rerun draftsmith data regenerate --target" in err


def test_llamacpp_engine_without_a_build_names_the_install_command(
    target_dir, data, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("DRAFTSMITH_LLAMACPP", str(tmp_path / "no-build"))
    gguf = tmp_path / "target.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "o.jsonl"
    assert main(["data", "regenerate", "--target", str(gguf), "--data", str(data), "--out", str(out),
                 "--engine", "llamacpp"]) == 2  # fmt: skip
    assert "run `bash scripts/install_llamacpp.sh`" in capsys.readouterr().err
    assert main(["data", "regenerate", "--target", str(target_dir), "--data", str(data), "--out", str(out),
                 "--engine", "llamacpp"]) == 2  # fmt: skip
    assert "--engine llamacpp serves a GGUF" in capsys.readouterr().err
    assert not out.exists()


def test_a_time_budget_starts_no_conversation_after_it_and_a_rerun_goes_on(target, server, data, tmp_path):
    out = tmp_path / "out.jsonl"
    stats = served(target, data, out, [server.url], max_seconds=0)
    assert stats.written == 0 and stats.left_for_later == 6 and server.completions == 0
    stats = served(target, data, out, [server.url])
    assert stats.written == 6 and [r["source_id"] for r in lines(out)] == [
        f"train.jsonl:{i}" for i in range(6)
    ]
