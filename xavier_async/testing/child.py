"""A Python child process driven over a socket pair (peer endpoints, the xoscar anchor).

The child is ``python -m <module> <fd> <args...>``; it answers every message with
``("ok", value)`` or ``("error", text)``. Blocking calls: use them from a worker thread
(``anyio.to_thread.run_sync``) inside async code.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any


Handler = Callable[[Any], Awaitable[Any]]


async def serve_commands(conn: Connection, handlers: Mapping[str, Handler]) -> None:
    """Child side: answer the parent's ``(command, arg)`` messages with
    ``("ok", await handlers[command](arg))`` or ``("error", text)`` until ``"close"``, which
    is answered ``("ok", "closed")``. The pipe is read from a worker thread."""
    import anyio

    while True:
        cmd, arg = await anyio.to_thread.run_sync(conn.recv)
        if cmd == "close":
            break
        try:
            handler = handlers.get(cmd)
            if handler is None:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", await handler(arg)))
        except Exception as exc:
            send_error(conn, exc)
    conn.send(("ok", "closed"))


def send_error(conn: Connection, exc: BaseException) -> None:
    """Child side: answer with ``("error", text)``, the traceback included (best effort:
    the parent may be gone)."""
    import traceback
    try:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    except Exception:
        pass


class ChildProcess:
    """Start ``python -m module fd *args`` with a connected pipe on ``fd``."""

    def __init__(self, module: str, args: Sequence[str], name: str, *,
                 env: Mapping[str, str] | None = None, wrapper: Sequence[str] | None = None) -> None:
        mine, theirs = socket.socketpair()
        self.name = name
        self.proc = subprocess.Popen(
            [*(wrapper or []), sys.executable, "-m", module, str(theirs.fileno()), *args],
            pass_fds=(theirs.fileno(),), env={**os.environ, **(env or {})})
        theirs.close()
        self.conn = Connection(mine.detach())

    def reply(self, timeout: float) -> Any:
        """The child's next answer; raises if it failed, exited or took too long."""
        if not self.conn.poll(timeout):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            raise TimeoutError(f"{self.name} did not answer in {timeout:.0f} s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            self.proc.wait(5)
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}") from None
        if status != "ok":
            raise RuntimeError(f"{self.name} failed: {value}")
        return value

    def send(self, message: Any) -> None:
        self.conn.send(message)

    def call(self, cmd: str, arg: Any = None, timeout: float = 60.0) -> Any:
        self.conn.send((cmd, arg))
        return self.reply(timeout)

    def kill(self) -> None:
        """SIGKILL: the child dies without closing anything."""
        self.proc.kill()
        self.proc.wait(10)

    def close(self, goodbye: Any = None, timeout: float = 30.0) -> None:
        """Send ``goodbye`` (if any), wait for the child to exit, kill it if it does not."""
        if self.proc.poll() is None and goodbye is not None:
            try:
                self.conn.send(goodbye)
                self.reply(timeout)
            except Exception:
                pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.conn.close()
