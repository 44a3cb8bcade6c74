"""Regeneration through serving engines: the target's replies from OpenAI-compatible servers.

vLLM, SGLang, llama.cpp's ``llama-server`` and others serve ``POST /v1/completions``. draftsmith renders
each prompt with the target's chat template itself and sends the exact token ids (``"prompt": [ids]``),
so the server's own template never enters; before any work, ``check_server`` proves the server's model
reads those ids as the target does (vocabulary size, and the server's tokenization of a probe text
against the target tokenizer's, naming the first token that differs).

Many requests are in flight per server and several servers (replicas) are used at once: each in-flight
slot is a thread that takes the next conversation in input order and asks for its replies turn by turn.
Finished conversations are written in input order (held back until the ones before them are written),
appended and flushed one by one, so a killed run resumes after the last written row with every row once,
in order. A server that stops answering is retried with backoff; after the last try the run stops, what
was written stays, and the error says how to resume. A request the server refuses (HTTP 4xx: a prompt too
long for it, say) costs only its conversation: that one goes to the errors file beside the output
(``errors_path``) with the reason, and the job goes on; a rerun tries it again.
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from draftsmith.openai_client import CompletionServer, RequestRefused, ServerError, check_server
from draftsmith.train.corpus.prompts import read_done, source_conversations, take_shard
from draftsmith.train.corpus.regenerate import Dialogue, RegenerateStats
from draftsmith.train.corpus.tokens import check_chat_template


def errors_path(out: str | Path) -> Path:
    """Where the conversations a server refused are listed: beside ``out``, named so that no pattern of
    output files (``part-*.jsonl``) takes it for data."""
    out = Path(out)
    return out.with_name(out.name + ".errors")


def regenerate_served(
    tokenizer,
    paths: Sequence[str | Path],
    out: str | Path,
    servers: Sequence[CompletionServer],
    vocab_size: int,
    max_new_tokens: int = 512,
    in_flight: int = 8,
    temperature: float = 0.0,
    limit: int | None = None,
    max_prompt_tokens: int | None = None,
    seed: int = 0,
    shard: tuple[int, int] | None = None,
    generator: dict | None = None,
    progress: bool = True,
    resume_hint: str = "run the same command again",
    max_seconds: float | None = None,
    reasoning: str = "keep",
    system: str | None = None,
    template_args: dict | None = None,
) -> RegenerateStats:
    """Rewrite the assistant turns of the conversations in ``paths`` with replies from ``servers``; append
    to ``out`` in input order; a conversation with a refused request goes to ``errors_path(out)`` instead.

    ``in_flight``: requests at once per server. ``shard=(i, n)``: only conversations whose index in the
    input is i modulo n (so n jobs write disjoint files). ``generator`` (engine, weights, ...) is written
    into every record. ``max_prompt_tokens`` defaults to the smallest server context less max_new_tokens.
    ``max_seconds``: start no conversation after this long (those in flight finish); a rerun goes on.
    ``reasoning``, ``system`` and ``template_args``: see ``Dialogue``.
    """
    if not servers:
        raise ValueError("no server given")
    if in_flight < 1 or max_new_tokens < 1:
        raise ValueError(f"in_flight ({in_flight}) and max_new_tokens ({max_new_tokens}) must be at least 1")
    check_chat_template(tokenizer)
    contexts = [check_server(server, tokenizer, vocab_size)["context"] for server in servers]
    generator = {**(generator or {}), "model": ", ".join(sorted({str(s.model) for s in servers}))}
    known = [c for c in contexts if c]
    if max_prompt_tokens is None and known:
        max_prompt_tokens = min(known) - max_new_tokens
        if max_prompt_tokens < 1:
            raise ValueError(
                f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the server's context of "
                f"{min(known)} tokens"
            )
    out = Path(out)
    done = read_done(out)
    sources = take_shard(source_conversations(paths, limit), shard)
    todo = [Dialogue(sid, msgs, reasoning, system, template_args) for sid, msgs in sources if sid not in done]
    stats = RegenerateStats(already_done=len(sources) - len(todo))
    lock = threading.Lock()
    finished: dict[int, Dialogue | dict] = {}  # a dict: the error line of a refused conversation
    failure: list[BaseException] = []
    next_index = iter(range(len(todo)))
    deadline = None if max_seconds is None else time.perf_counter() + max_seconds

    def work(server: CompletionServer) -> None:
        while not failure:
            with lock:
                i = (
                    None
                    if deadline is not None and time.perf_counter() > deadline
                    else next(next_index, None)
                )
            if i is None:
                return
            dialogue = todo[i]
            turn = 0
            try:
                while (ids := dialogue.next_ids(tokenizer, max_prompt_tokens)) is not None:
                    request_seed = (
                        seed + zlib.crc32(dialogue.source_id.encode()) + turn
                    )  # the same on a rerun
                    reply = server.complete(ids, max_new_tokens, temperature, request_seed)
                    dialogue.answer(reply.text, reply.finished)
                    turn += 1
                    with lock:
                        stats.replies += 1
                        stats.tokens += reply.tokens
                        stats.truncated_replies += not reply.finished
            except RequestRefused as err:
                refusal = {"source_id": dialogue.source_id, "turn": len(dialogue.out), "status": err.status,
                           "reason": err.reason, "server": server.url}  # fmt: skip
                with lock:
                    finished[i] = refusal
                continue
            except BaseException as err:  # noqa: BLE001 (handed to the main thread, which raises it)
                with lock:
                    failure.append(err)
                return
            with lock:
                finished[i] = dialogue

    out.parent.mkdir(parents=True, exist_ok=True)
    threads = [
        threading.Thread(target=work, args=(s,), daemon=True) for s in servers for _ in range(in_flight)
    ]
    written = 0
    with out.open("a", encoding="utf-8") as f, tqdm(total=len(sources), initial=stats.already_done,
                                                      desc="regenerate", unit="conv", disable=not progress) as bar:  # fmt: skip

        def flush() -> None:
            nonlocal written
            while True:
                with lock:
                    dialogue = finished.pop(written, None)
                if dialogue is None:
                    return
                written += 1
                bar.update(1)
                if isinstance(dialogue, dict):
                    with errors_path(out).open("a", encoding="utf-8") as errors:
                        errors.write(json.dumps(dialogue, ensure_ascii=False) + "\n")
                    stats.refused += 1
                    continue
                f.write(json.dumps(dialogue.record(generator), ensure_ascii=False) + "\n")
                f.flush()
                stats.written += 1
                stats.cut_conversations += dialogue.cut

        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            flush()
            time.sleep(0.05)
        flush()
    stats.left_for_later = len(sources) - stats.already_done - stats.written - stats.refused
    if failure:
        err = failure[0]
        raise ServerError(
            f"regeneration stopped: {err}\n{stats.written} conversations were written to {out} (in order; "
            f"{stats.already_done + stats.written} of {len(sources)} done). Once the server answers again, "
            f"{resume_hint}: it resumes after the last written row."
        ) from err
    return stats


SLOT_CONTEXT = 8192
"""Tokens of context per llama-server slot at most (the target's own context where it is smaller): the
KV cache is slots x this, allocated when the server starts."""


def target_gguf(spec: str) -> Path:
    """The GGUF llama-server runs for ``--target``: the bundled file for the alias, or a .gguf target."""
    from draftsmith.loading import SMOLLM2_ALIAS, smollm2_gguf_path

    if spec == SMOLLM2_ALIAS:
        return smollm2_gguf_path()
    if spec.endswith(".gguf") and Path(spec).is_file():
        return Path(spec)
    raise ValueError(
        f"--engine llamacpp serves a GGUF, and --target {spec} is not one: pass the target as a .gguf file "
        "(llama.cpp's convert_hf_to_gguf.py makes one), or serve it yourself (vLLM, SGLang) and pass --server URL"
    )
