"""An OpenAI-compatible server as draftsmith talks to it: token ids in, replies out, and a check that
the server's model is the target.

vLLM, SGLang, llama.cpp's ``llama-server`` and others serve ``POST /v1/completions``. draftsmith renders
each prompt with the target's chat template itself and sends the exact token ids (``"prompt": [ids]``),
so the server's own template never enters; ``check_server`` proves the server's model reads those ids
as the target does (vocabulary size, and the server's tokenization of a probe text against the target
tokenizer's, naming the first token that differs). Used by ``data regenerate --server`` and
``eval --server``.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

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


class RequestRefused(ServerError):
    """The server refused one request (HTTP 4xx: too long, malformed, ...): asking again will not help, but
    the server is up and other requests may go on."""

    def __init__(self, message: str, status: int, reason: str):
        super().__init__(message)
        self.status, self.reason = status, reason


RETRIED_4XX = (408, 429)
"""Refusals that are about the moment, not the request (timeout, too many requests): retried as 5xx are."""


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
                if (
                    err.code < 500 and err.code not in RETRIED_4XX
                ):  # the request is wrong: asking again will not help
                    raise RequestRefused(
                        f"{self.url}{path} answered HTTP {err.code}: {detail}", err.code, detail
                    ) from err
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

    def greedy_ids(self, prompt: list[int], max_tokens: int) -> list[int]:
        """The token ids of a greedy completion of ``prompt`` (vLLM's ``return_token_ids``, llama-server's
        ``tokens``): what a lossless comparison of outputs needs, which a reply's text does not give."""
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
                "top_k": 1, "seed": 0, "stream": False, "return_token_ids": True, "return_tokens": True}  # fmt: skip
        answer = self._request("/v1/completions", body)
        choice = (answer.get("choices") or [{}])[0] if isinstance(answer, dict) else {}
        ids = choice.get("token_ids") or choice.get("tokens")
        if not isinstance(ids, list):
            raise ServerError(
                f"{self.url}/v1/completions answered without the generated token ids (vLLM's return_token_ids): "
                f"{str(answer)[:300]}"
            )
        return [int(t) for t in ids]

    def metrics(self) -> str:
        """The server's Prometheus page (``/metrics``), as text."""
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=self.timeout) as response:
                return response.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as err:
            raise ServerError(f"{self.url}/metrics answered HTTP {err.code}: it exposes no metrics") from err
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
            raise ServerError(f"{self.url} did not answer /metrics: {err}") from err


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
