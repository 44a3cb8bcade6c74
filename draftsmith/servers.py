"""A serving engine's HTTP server started by draftsmith (llama-server, ``vllm serve``) for a ``with`` block.

What every such server needs, once: a free local port, a child process that the kernel ends when
draftsmith dies (even by SIGKILL: a killed job must not leave an engine's threads spinning), a wait for
its health endpoint that shows the log's tail when it exits early, a stop that escalates to SIGKILL, and
JSON over HTTP. An engine's module subclasses ``LocalServer`` with its command line.

An engine that starts processes of its own (vLLM: an engine core and workers, which outlive a killed API
server) runs under ``supervise`` (``whole_tree``): a small process of draftsmith's that starts the engine
in a session of its own and, when told to stop or when draftsmith dies, ends every process in it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In the server's process, before it runs: on Linux, have the kernel send it ``sig`` when the process
    that started it dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, sig)  # PR_SET_PDEATHSIG


def _term_with_parent() -> None:
    die_with_parent(signal.SIGTERM)  # the supervisor catches it and ends the engine's whole session


def supervise(cmd: list[str], parent: int, grace: float = 10.0) -> int:
    """Run ``cmd`` in a session of its own; on SIGTERM (a stop, or the death of ``parent``, the process that
    started this one: see ``_term_with_parent``) end every process of that session, SIGTERM then SIGKILL."""
    child = subprocess.Popen(cmd, start_new_session=True)

    def end_session(*_) -> None:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0)):
            try:
                os.killpg(child.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and child.poll() is None:
                time.sleep(0.1)
        sys.exit(143)

    signal.signal(signal.SIGTERM, end_session)
    if os.getppid() != parent:  # draftsmith died before this process could be told when it does
        end_session()
    code = child.wait()
    try:
        os.killpg(child.pid, signal.SIGKILL)  # what the engine left behind when it exited by itself
    except ProcessLookupError:
        pass
    return code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """A server on a free local port for the length of a ``with`` block; subclasses give ``command()``."""

    title = "server"
    """What errors call it (``llama-server``, ``vLLM``)."""
    whole_tree = False
    """Run under ``supervise``, so that the processes the engine starts end with it."""

    def __init__(self, log: str | Path | None = None, start_timeout: float = 120.0):
        self.log, self.start_timeout = log, start_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen | None = None
        self._log_file = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str] | None:
        """The server's environment (None: draftsmith's own)."""
        return None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def log_tail(self, chars: int = 2000) -> str:
        return Path(self.log).read_text(errors="replace")[-chars:] if self.log else "(pass log= to see why)"

    def __enter__(self):
        out = open(self.log, "w") if self.log else subprocess.DEVNULL  # noqa: SIM115 (closed in __exit__)
        self._log_file = out if self.log else None
        cmd, preexec = self.command(), die_with_parent
        if self.whole_tree:
            cmd = [sys.executable, "-m", "draftsmith.servers", str(os.getpid()), *cmd]
            preexec = _term_with_parent
        self._proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=self.environment(), preexec_fn=preexec
        )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self.__exit__(None, None, None)
                raise RuntimeError(f"{self.title} exited with code {code}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        self.__exit__(None, None, None)
        raise TimeoutError(
            f"{self.title} did not become ready within {self.start_timeout:.0f} s:\n{self.log_tail()}"
        )

    def __exit__(self, *exc) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def get_text(self, path: str, timeout: float = 30.0) -> str:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout) as r:
            return r.read().decode()

    def post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        request = urllib.request.Request(
            f"{self.url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return json.loads(r.read())


if __name__ == "__main__":
    sys.exit(supervise(sys.argv[2:], int(sys.argv[1])))
