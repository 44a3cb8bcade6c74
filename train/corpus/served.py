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
was written stays, and the error says how to resume.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from draftsmith.train.corpus.prompts import read_done, source_conversations, take_shard
from draftsmith.train.corpus.regenerate import Dialogue, RegenerateStats
from draftsmith.train.corpus.tokens import check_chat_template

PROBE = (
    "Speculative decoding, déjà vu: 12345 + 67890 = 80235.\n\tdef f(x):\n        return x ** 2  # ok\n"
    "日本語のテキスト, ¿qué tal? 🙂 <|im_start|> </s> [INST]"
)
"""Text whose tokenization tells tokenizers apart: digits, code indentation, accents, CJK, an emoji, and
strings that are special tokens in common chat templates."""

RETRIES = 5
"""Tries of one request before a server counts as gone (backoff 1, 2, 4, 8 s between them)."""


class ServerError(ValueError):
    """A server answered wrongly, or not at all after every retry (the command line prints it in one line,
    as it does bad input, and exits non-zero)."""


@dataclass
class Reply:
    text: str
    tokens: int
    """tokens the server generated (its ``usage.completion_tokens``)"""
    finished: bool
    """the reply ended on an end-of-turn token (``finish_reason`` "stop"), not at max_tokens"""


class CompletionServer:
    """One OpenAI-compatible server at ``url`` (``http://host:port``, with or without ``/v1``)."""

    def __init__(self, url: str, timeout: float = 600.0, retries: int = RETRIES, backoff: float = 1.0):
        self.url = url.rstrip("/").removesuffix("/v1")
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.model: str | None = None

    def _request(self, path: str, body: dict | None = None, retry: bool = True) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.url}{path}", data=data, headers={"Content-Type": "application/json"}
        )
        last: Exception | None = None
        for attempt in range(self.retries if retry else 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
            except urllib.error.HTTPError as err:
                detail = err.read().decode("utf-8", "replace")[:500]
                if err.code < 500:  # the request is wrong: asking again will not help
                    raise ServerError(f"{self.url}{path} answered HTTP {err.code}: {detail}") from err
                last = ServerError(f"HTTP {err.code}: {detail}")
                continue
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
                last = err
                continue
            try:
                return json.loads(raw)
            except json.JSONDecodeError as err:
                raise ServerError(
                    f"{self.url}{path} answered something that is not JSON: {raw[:200]!r}"
                ) from err
        raise ServerError(f"{self.url} did not answer {path} after {self.retries} tries: {last}")

    def models(self) -> list[dict]:
        answer = self._request("/v1/models")
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list) or not data:
            raise ServerError(f"{self.url}/v1/models lists no model: {str(answer)[:200]}")
        return data

    def tokenize(self, text: str) -> list[int] | None:
        """The server's token ids for ``text`` (no BOS, special tokens parsed), or None when it has no
        tokenize endpoint. One body serves llama-server (``content``) and vLLM/SGLang (``prompt``)."""
        body = {"model": self.model, "content": text, "prompt": text, "add_special": False,
                "add_special_tokens": False, "parse_special": True}  # fmt: skip
        try:
            answer = self._request("/tokenize", body, retry=False)
        except ServerError as err:
            if "HTTP 404" in str(err) or "HTTP 405" in str(err):
                return None
            raise
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list):
            raise ServerError(f"{self.url}/tokenize answered without a token list: {str(answer)[:200]}")
        return [t["id"] if isinstance(t, dict) else int(t) for t in tokens]

    def complete(self, prompt: list[int], max_tokens: int, temperature: float, seed: int) -> Reply:
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens,
                "temperature": temperature, "seed": seed, "stream": False}  # fmt: skip
        if temperature == 0:
            body["top_k"] = (
                1  # llama-server, vLLM and SGLang all take it; greedy even where 0 means "default"
            )
        answer = self._request("/v1/completions", body)
        try:
            choice = answer["choices"][0]
            text, reason = choice["text"], choice.get("finish_reason")
            tokens = int(answer.get("usage", {}).get("completion_tokens", 0))
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise ServerError(
                f"{self.url}/v1/completions answered without choices[0].text: {str(answer)[:300]}"
            ) from err
        if not isinstance(text, str) or reason not in ("stop", "length", "eos"):
            raise ServerError(
                f"{self.url}/v1/completions answered an unexpected reply (finish_reason {reason!r}): "
                f"{str(answer)[:300]}"
            )
        return Reply(text, tokens, reason != "length")


def check_server(server: CompletionServer, tokenizer, vocab_size: int) -> dict:
    """Refuse a server whose model is not the target: another vocabulary size, or another tokenization of
    ``PROBE`` (the first differing token named). Returns what it learned (model id, context per request)."""
    models = server.models()
    server.model = str(models[0].get("id"))
    meta = models[0].get("meta") or {}
    n_vocab = meta.get("n_vocab") or models[0].get("vocab_size")
    if n_vocab is not None and int(n_vocab) not in (vocab_size, len(tokenizer)):
        raise ServerError(
            f"{server.url} serves {server.model!r} with a vocabulary of {n_vocab} tokens, but the target has "
            f"{vocab_size}: it is another model. Serve the target (or pass the --target it serves)."
        )
    ours = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    theirs = server.tokenize(PROBE)
    if theirs is None:
        raise ServerError(
            f"{server.url} has no /tokenize endpoint, so draftsmith cannot check that it reads token ids as the "
            "target does. Serve with vLLM, SGLang or llama-server (they have one)."
        )
    if theirs != ours:
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))

        def name(ids, i):
            return f"{ids[i]} ({tokenizer.decode([ids[i]])!r})" if i < len(ids) else "nothing (it ends)"

        raise ServerError(
            f"{server.url} ({server.model!r}) tokenizes differently from the target: at token {at} of a probe text "
            f"the target has {name(ours, at)} and the server {name(theirs, at)}. It serves another model or "
            "tokenizer; serve the target (or pass the --target it serves)."
        )
    context = meta.get("n_ctx") or models[0].get("max_model_len")
    props = None
    try:
        props = server._request("/props", retry=False)
    except ServerError:
        pass
    if isinstance(props, dict):  # llama-server: the context of one slot (its -c split over -np)
        context = (props.get("default_generation_settings") or {}).get("n_ctx") or context
    return {"model": server.model, "context": int(context) if context else None}


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
) -> RegenerateStats:
    """Rewrite the assistant turns of the conversations in ``paths`` with replies from ``servers``; append
    to ``out`` in input order.

    ``in_flight``: requests at once per server. ``shard=(i, n)``: only conversations whose index in the
    input is i modulo n (so n jobs write disjoint files). ``generator`` (engine, weights, ...) is written
    into every record. ``max_prompt_tokens`` defaults to the smallest server context less max_new_tokens.
    ``max_seconds``: start no conversation after this long (those in flight finish); a rerun goes on.
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
    todo = [Dialogue(sid, msgs) for sid, msgs in sources if sid not in done]
    stats = RegenerateStats(already_done=len(sources) - len(todo))
    lock = threading.Lock()
    finished: dict[int, Dialogue] = {}
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
                f.write(json.dumps(dialogue.record(generator), ensure_ascii=False) + "\n")
                f.flush()
                written += 1
                stats.written += 1
                stats.cut_conversations += dialogue.cut
                bar.update(1)

        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            flush()
            time.sleep(0.05)
        flush()
    stats.left_for_later = len(sources) - stats.already_done - stats.written
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


def target_tokenizer(spec: str, chat_template: str | None = None):
    """(tokenizer, text config, display name) of ``--target``, without loading its weights."""
    from transformers import AutoConfig, AutoTokenizer

    from draftsmith.loading import resolve_model_path

    path, name = resolve_model_path(spec)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if chat_template is not None:
        tokenizer.chat_template = Path(chat_template).read_text(encoding="utf-8")
    return tokenizer, AutoConfig.from_pretrained(path).get_text_config(decoder=True), name


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


def run_served(args, engine: str, shard: tuple[int, int] | None) -> tuple[RegenerateStats, str]:
    """``draftsmith data regenerate`` with ``--server`` URLs or ``--engine llamacpp``: (stats, target name)."""
    import os
    import shlex
    import sys
    from contextlib import nullcontext

    from draftsmith import files

    files.check_writable(Path(args.out).parent, f"--out {args.out}: the folder")
    argv = getattr(args, "argv", None)
    resume = "rerun " + shlex.join(["draftsmith", *argv]) if argv else "run the same command again"
    if engine == "llamacpp":
        from draftsmith import llamacpp

        gguf = target_gguf(args.target)
        llamacpp.tool("llama-server")  # the install command, before the target's tokenizer loads
    tokenizer, config, name = target_tokenizer(args.target, args.chat_template)
    context = min(getattr(config, "max_position_embeddings", None) or SLOT_CONTEXT, SLOT_CONTEXT)
    if engine == "llamacpp":
        slots, threads = args.batch_size, os.cpu_count() or 1
        print(
            f"llama-server: {gguf.name}, {slots} slots of {context} tokens, {threads} threads",
            file=sys.stderr,
        )
        running = llamacpp.Server(gguf, ["-np", str(slots), "-c", str(slots * context)], threads=threads)
        generator = {
            "engine": "llama.cpp",
            "weights": gguf.name,
            "llama_cpp": f"llama-cpp-python {llamacpp.LLAMACPP_PY_VERSION} sdist",
        }
    else:
        running, generator = nullcontext(), {"engine": "server"}
    with running as server:
        urls = [server.url] if engine == "llamacpp" else args.server
        servers = [CompletionServer(url) for url in urls]
        stats = regenerate_served(
            tokenizer, args.data, args.out, servers, config.vocab_size,
            max_new_tokens=args.max_new_tokens, in_flight=args.batch_size, temperature=args.temperature,
            limit=args.limit, max_prompt_tokens=args.max_prompt_tokens, seed=args.seed, shard=shard,
            generator=generator, resume_hint=resume,
            max_seconds=None if args.max_minutes is None else args.max_minutes * 60,
        )  # fmt: skip
    return stats, name
