"""Addresses, ports and threads, shared by the server, its launcher, the client, the pool and the weight group."""
from __future__ import annotations

import ipaddress
import queue
import socket
import threading
from concurrent.futures import Future
from typing import Any, Callable


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def local_address_towards(host: str) -> str:
    """The address of this machine that `host` can reach back: the source address of a route to it (no packet is
    sent: a UDP connect only picks the route). Loopback for a loopback host."""
    if is_loopback(host):
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), port 0 for a free one; the caller listens or hands it on."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now (another process may take it before it is used: hold a `bind_socket` where that matters)."""
    with bind_socket(host, 0) as sock:
        return sock.getsockname()[1]


def in_thread(fn: Callable[..., Any], *args: Any) -> Future:
    """fn(*args) in a daemon thread of its own (never one that exiting would wait for); its Future."""
    future: Future = Future()
    threading.Thread(target=_settle, args=(future, fn, *args), name=getattr(fn, "__name__", "task"),
                     daemon=True).start()
    return future


def _settle(future: Future, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """fn's result, or the exception it raised, into `future`."""
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as error:  # noqa: BLE001 (the Future carries it)
        future.set_exception(error)


class OneThread:
    """Runs what it is given on one daemon thread, in order (exiting never waits for it): where a thread's
    identity matters, as the CPU engine's (apmpo.rollout.server)."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) on the thread; its result, or its exception raised here."""
        future: Future = Future()
        self._calls.put((future, fn, args, kwargs))
        return future.result()

    def _serve(self) -> None:
        while True:
            future, fn, args, kwargs = self._calls.get()
            _settle(future, fn, *args, **kwargs)
