"""The directory's feed inside one replica: worker process -> scheduler process.

vLLM runs the connector's scheduler side in the EngineCore process and its worker side
in a worker process. Peers' announcements reach the worker (over the endpoint's own
connection to each peer); this feed relays them to the scheduler over a local socket
(an abstract Unix socket named after the replica's ``listen`` address), one JSON line an
update, so the scheduler's directory is current without an engine step. The worker
keeps the authoritative copy: on every (re)connection it sends the whole of it first."""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
from collections.abc import Callable
from typing import Any

from .directory import Directory

log = logging.getLogger("xavier_async.vllm")


def feed_name(listen: str) -> str:
    """The feed's socket name for the replica listening at ``listen``."""
    return "\0xavier-async-vllm-directory/" + listen


def apply(directory: Directory, update: dict[str, Any]) -> None:
    """One feed update applied to ``directory`` (unknown operations are ignored)."""
    op, peer = update.get("op"), update.get("peer")
    if type(peer) is not int:
        return
    keys = update.get("keys", [])
    if op == "published":
        directory.published(peer, keys)
    elif op == "evicted":
        directory.evicted(peer, keys)
    elif op == "replace":
        directory.replace(peer, keys)
    elif op == "gone":
        directory.gone(peer)


def snapshot(directory: Directory) -> list[dict[str, Any]]:
    """``directory`` as the updates that rebuild it."""
    return [{"op": "replace", "peer": p, "keys": sorted(directory.keys_of(p))}
            for p in directory.peers]


class FeedServer:
    """The scheduler's end: applies updates to ``directory`` under ``lock``, on a
    daemon thread of its own."""

    def __init__(self, name: str, directory: Directory, lock: threading.Lock) -> None:
        self.directory, self._lock = directory, lock
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(name)
        self._sock.listen(8)
        self._closed = False
        #: feed connections seen (a worker that restarts connects again)
        self.connections = 0
        threading.Thread(target=self._accept, name="xavier-directory-feed", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._read, args=(conn,), daemon=True,
                             name="xavier-directory-feed-conn").start()

    def _read(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as lines:
            for line in lines:
                try:
                    update = json.loads(line)
                except ValueError:
                    log.warning("directory feed: dropped a malformed update")
                    continue
                if isinstance(update, dict):
                    with self._lock:
                        apply(self.directory, update)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class FeedClient:
    """The worker's end: :meth:`send` never blocks; a thread writes, reconnecting (and
    resending ``full()`` first) whenever the scheduler's end is not there."""

    def __init__(self, name: str, full: Callable[[], list[dict[str, Any]]]) -> None:
        self._name, self._full = name, full
        self._queue: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="xavier-directory-feed", daemon=True)
        self._thread.start()

    def send(self, update: dict[str, Any]) -> None:
        self._queue.put(update)

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.connect(self._name)
                    for update in self._full():
                        sock.sendall(json.dumps(update).encode() + b"\n")
                    while True:
                        item = self._queue.get()
                        if item is None:
                            return
                        sock.sendall(json.dumps(item).encode() + b"\n")
            except OSError:
                self._closed.wait(0.05)

    def close(self) -> None:
        self._closed.set()
        self._queue.put(None)
        self._thread.join(timeout=2)


__all__ = ["FeedServer", "FeedClient", "feed_name", "apply", "snapshot"]
