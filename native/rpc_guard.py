"""What llama.cpp's RPC client lacks: bounded waits, and a sentence instead of a bare abort.

llama.cpp's client blocks in ``recv`` on its worker sockets without a limit, and on any
transport error calls ``GGML_ABORT`` on its dispatcher thread (``RPC_STATUS_ASSERT``),
which ends the process: no error comes back to the caller.  Two things here, for
native.rpc:

- :class:`SocketGuard` finds this process's sockets connected to a worker (they are
  llama.cpp's: it opens them) and sets ``SO_RCVTIMEO``/``SO_SNDTIMEO`` on them, so a hung
  worker becomes a transport error after a bounded time.
- :func:`install_abort_handler` installs a ggml abort callback which, for an RPC failure,
  writes one sentence naming the worker (stderr, and the first line of the crash trace
  the next start reads), then ends the process with exit status 1.

Both read sockets by descriptor, which exists on POSIX only; on Windows the guard does
nothing (the wait there is not bounded) and the abort is reported without telling a
closed connection from a silent one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from native.endpoint import Endpoint

log = logging.getLogger("native")

#: Seconds llama.cpp may wait on one receive or send before the worker counts as hung.
#: A worker computes a whole batch before answering: slow CPUs with big models need more.
IO_TIMEOUT_S = 120.0


# -- bounded waits on llama.cpp's own sockets ------------------------------------------------------

def _own_fds() -> list[int]:
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return [int(name) for name in os.listdir(folder) if name.isdigit()]
        except OSError:
            continue
    return []


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


#: descriptor -> worker, for each socket to a worker a guard has seen (read when llama.cpp aborts)
_worker_fds: dict[int, Endpoint] = {}
#: descriptors a guard shut down for want of progress (a hung worker, not a closed one)
_stuck_fds: set[int] = set()


def _peer_sockets(peers: set[tuple[str, int]]):
    """(fd, duplicate socket) for each socket of this process connected to one of ``peers``."""
    for fd in _own_fds():
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            peer = sock.getpeername()
        except OSError:
            sock.close()
            continue
        if isinstance(peer, tuple) and (peer[0], peer[1]) in peers:
            yield fd, sock
        else:
            sock.close()


def _addresses(endpoints: Iterable[Endpoint]) -> set[tuple[str, int]]:
    out: set[tuple[str, int]] = set()
    for ep in endpoints:
        try:
            for info in socket.getaddrinfo(ep.host, ep.port, socket.AF_INET, socket.SOCK_STREAM):
                out.add((str(info[4][0]), ep.port))   # AF_INET: (host, port)
        except socket.gaierror:
            pass
    return out


class SocketGuard:
    """While active, gives llama.cpp's sockets to the workers receive/send timeouts.

    llama.cpp's RPC client blocks in ``recv`` without a limit; a worker that hangs (a
    stopped process, a machine that froze) would hang the model's thread for ever.  The
    guard looks for this process's sockets connected to a worker (every ``interval``
    seconds while it watches a call, every ``idle_interval`` otherwise) and sets
    ``SO_RCVTIMEO``/``SO_SNDTIMEO`` on them: the socket options belong to the socket, so
    a duplicate descriptor reaches llama.cpp's.  A timed-out call is then a transport
    error, which llama.cpp turns into the abort :func:`install_abort_handler` reports.

    A receive already waiting when the option is set keeps waiting (Linux reads the
    timeout when the call starts), and a new connection's handshake starts at once.  So
    around calls of ours that may open connections (registering, memory, loading the
    model) :meth:`watching` also watches for progress: load progress (:meth:`tick`) or
    bytes moving on the worker sockets (Linux); with none for ``timeout`` seconds, it
    shuts those sockets down, which ends the waiting call with a transport error.
    POSIX only (sockets are not file descriptors on Windows); elsewhere it does nothing.
    """

    def __init__(self, endpoints: Iterable[Endpoint], timeout: float, interval: float = 0.1,
                 idle_interval: float = 1.0) -> None:
        self.endpoints = tuple(endpoints)
        self.timeout = timeout
        self.interval = interval              # while watching a call that may connect
        self.idle_interval = idle_interval    # otherwise: connections seldom appear then
        self._peers: dict[tuple[str, int], Endpoint] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.guarded = 0          # sockets given a timeout so far (for tests and the log)
        self._fds: set[int] = set()
        self._configured: set[tuple[int, int]] = set()
        self._watching = False
        self._last_progress = 0.0
        self._traffic: tuple[int, int] | None = None

    @property
    def supported(self) -> bool:
        return os.name == "posix"

    def start(self) -> SocketGuard:
        if not self.supported or self._thread is not None:
            return self
        self._peers = {address: ep for ep in self.endpoints for address in _addresses([ep])}
        self._thread = threading.Thread(target=self._run, name="rpc-socket-guard", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2)
        for fd in self._fds:
            _worker_fds.pop(fd, None)
        self._fds.clear()

    @contextlib.contextmanager
    def watching(self):
        """While inside, a call of ours into llama.cpp must make progress (see above)."""
        self._last_progress = time.monotonic()
        self._traffic = None
        self._watching = True
        try:
            yield self
        finally:
            self._watching = False

    def tick(self) -> None:
        """Progress that moves no bytes we can see (a load progress callback)."""
        self._last_progress = time.monotonic()

    def _check_progress(self) -> None:
        now = time.monotonic()
        # the addresses resolved once at start: no name lookups ten times a second
        traffic = _traffic(set(self._peers) or _addresses(self.endpoints))
        if traffic is not None and traffic != self._traffic:
            self._traffic = traffic
            self._last_progress = now
        if now - self._last_progress <= self.timeout:
            return
        self._watching = False
        for fd, sock in _peer_sockets(set(self._peers)):
            with sock:
                _stuck_fds.add(fd)
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        log.warning("no progress from the workers for %g s: their connections are shut down", self.timeout)

    def __enter__(self) -> SocketGuard:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def apply(self) -> int:
        """Set the timeouts on each worker socket not seen before; returns how many
        worker sockets there are now.  A socket is set once (by descriptor and inode, as
        descriptors are reused), so a timeout set on it later by someone else stays."""
        n = 0
        value = _timeval(self.timeout)
        if not self._peers:
            self._peers = {address: ep for ep in self.endpoints for address in _addresses([ep])}
        for fd, sock in _peer_sockets(set(self._peers)):
            with sock:
                try:
                    key = (fd, os.fstat(fd).st_ino)
                    if key not in self._configured:
                        peer = sock.getpeername()
                        _worker_fds[fd] = self._peers[(peer[0], peer[1])]
                        self._fds.add(fd)
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
                        self._configured.add(key)
                    n += 1
                except OSError:
                    pass
        return n

    def _run(self) -> None:
        seen = 0
        while not self._stop.is_set():
            try:
                n = self.apply()
            except Exception:  # noqa: BLE001 - the guard must never take the process down
                log.exception("worker socket guard failed")
                return
            if n != seen:
                log.debug("worker sockets under a %g s timeout: %d", self.timeout, n)
                seen = n
            self.guarded = max(self.guarded, n)
            if self._watching:
                self._check_progress()
            self._stop.wait(self.interval if self._watching else self.idle_interval)


def worker_traffic(endpoints: Iterable[Endpoint]) -> tuple[int, int] | None:
    """Bytes this process has sent to and received from the workers so far, over the
    connections open now (Linux TCP_INFO: bytes_acked, bytes_received); None elsewhere."""
    return _traffic(_addresses(endpoints))


def _traffic(peers: set[tuple[str, int]]) -> tuple[int, int] | None:
    if not sys.platform.startswith("linux"):
        return None
    sent = received = 0
    for _fd, sock in _peer_sockets(peers):
        with sock:
            try:
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
                acked, got = struct.unpack_from("<QQ", info, 120)   # struct tcp_info, Linux >= 4.1
            except (OSError, struct.error):
                return None
            sent, received = sent + acked, received + got
    return sent, received


# -- when llama.cpp gives up --------------------------------------------------------------------------

_abort_lock = threading.Lock()
_abort_state: dict = {}


def _hung_peers() -> list[Endpoint]:
    """Workers whose connection a guard shut down because nothing moved."""
    return list(dict.fromkeys(ep for fd, ep in list(_worker_fds.items()) if fd in _stuck_fds))


def _closed_peers() -> list[Endpoint]:
    """Workers whose connection from this process (as the guards last saw it) shows
    end-of-file or a reset: after a reset the socket has no peer name any more, so the
    descriptor the guard noted is what says which worker it was."""
    closed = []
    for fd, ep in list(_worker_fds.items()):
        if fd in _stuck_fds:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:
            try:
                sock.getpeername()
                if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    closed.append(ep)
            except BlockingIOError:
                pass
            except OSError:       # not connected any more, reset, broken pipe
                closed.append(ep)
    return list(dict.fromkeys(closed))


def lost_worker_sentence(message: str, endpoints: Sequence[Endpoint], io_timeout: float,
                         closed: Sequence[Endpoint] = (), hung: Sequence[Endpoint] = ()) -> str:
    """What to tell the user about a llama.cpp RPC abort ``message``."""
    named = [ep for ep in endpoints if str(ep) in message]
    ending = ("; llama.cpp cannot continue without it and ends this process: the answer since "
              "the last autosave is lost, checkpoints are kept")
    if named:
        what = ("could not be reached" if "connect" in message.lower()
                else "refused the handshake" if "handshake" in message.lower() else "failed")
        return f"the remote worker {named[0]} {what}{ending}"
    if closed:
        return f"the remote worker {', '.join(map(str, closed))} closed the connection (stopped or crashed){ending}"
    suspects = list(hung) or list(endpoints)
    who = (f"the remote worker {suspects[0]}" if len(suspects) == 1
           else f"one of the remote workers {', '.join(map(str, suspects))}")
    return f"{who} stopped answering (no reply within {io_timeout:g} s, or a broken connection){ending}"


class AbortHook(Protocol):
    """ggml's abort callback setter and its C function type (native.rpc's backend)."""
    abort_callback_type: Any
    set_abort_callback: Any


def install_abort_handler(hook: AbortHook, endpoints: Sequence[Endpoint], *, io_timeout: float = IO_TIMEOUT_S,
                          crash_note: Path | None = None, message_prefix: str = "error: ") -> None:
    """Turn llama.cpp's abort on a lost worker into one sentence and exit status 1.

    ggml calls ``abort()`` right after this callback, from llama.cpp's dispatcher thread:
    the process cannot continue.  For an RPC failure the callback writes the sentence to
    stderr and as the first line of ``crash_note`` (the crash trace file the next start
    reads, engine.crashlog), then ends the process with ``os._exit(1)``.  Any other
    abort keeps llama.cpp's own behaviour (message on stderr, then ``abort()``).
    Installed once per process; a later call updates the workers and the note file.
    """
    with _abort_lock:
        _abort_state.update(endpoints=tuple(dict.fromkeys([*_abort_state.get("endpoints", ()),
                                                            *endpoints])),
                            io_timeout=io_timeout, crash_note=crash_note, prefix=message_prefix)
        if "callback" in _abort_state:
            return

        def on_abort(raw: bytes | None) -> None:
            message = (raw or b"").decode("utf-8", "replace").strip()
            try:
                if "ggml-rpc" not in message:
                    os.write(2, (message + "\n").encode("utf-8", "replace"))
                    return            # ggml aborts as it always did
                with _abort_lock:     # a second failing worker waits for the first to exit
                    state = dict(_abort_state)
                    sentence = lost_worker_sentence(message, state["endpoints"], state["io_timeout"],
                                                    _closed_peers(), _hung_peers())
                    _leave(sentence, message, state)
            except BaseException:      # noqa: BLE001 - nothing may cross back into C
                os._exit(1)

        callback = hook.abort_callback_type(on_abort)
        hook.set_abort_callback(callback)
        _abort_state["callback"] = callback       # referenced for as long as ggml may call it


def _leave(sentence: str, message: str, state: dict) -> None:
    note: Path | None = state.get("crash_note")
    if note is not None and note.exists():
        try:
            with open(note, "r+", encoding="utf-8") as f:
                f.seek(0)
                f.write(f"Fatal: {sentence}\n(llama.cpp: {message})\n")
                f.truncate()
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            pass
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass
    os.write(2, f"{state.get('prefix', '')}{sentence}\n".encode("utf-8", "replace"))
    os._exit(1)
