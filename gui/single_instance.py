"""One Checkpoint Chat per user: a second start hands its files to the first and exits.

Double-clicking a ``.kvckpt`` runs ``CheckpointChat.exe "<file>"``.  Without this, a
second app started, loaded the model a second time (gigabytes of memory, minutes on a
CPU) and wrote into the same store as the first.  Now the first instance listens on a
``QLocalServer`` (a named pipe on Windows, a Unix socket elsewhere) whose name is derived
from the data folder, so each user (and each ``CHECKPOINT_CHAT_HOME``) has its own; a
later start connects, sends its files as one JSON line, waits for ``ok`` and exits, and
the first instance imports them and comes to the front.

The protocol, one exchange per connection: the client writes ``["<path>", ...]\\n``
(absolute paths, UTF-8); the server answers ``ok\\n`` once it has them.

Signals: ``files_received(list)`` on :class:`InstanceServer`, with the paths as strings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from PySide6.QtCore import QDeadlineTimer, QObject, Signal, Slot
from PySide6.QtNetwork import QLocalServer, QLocalSocket

from engine import paths

log = logging.getLogger("gui")

HAND_OVER_TIMEOUT_MS = 3000
#: how long a later start waits for the running instance's ``ok`` once connected: an
#: instance that accepted the connection is alive, perhaps busy (a loaded machine, a
#: slow Wine pipe); giving up early would start a second app
ANSWER_TIMEOUT_MS = 20_000
_MAX_MESSAGE = 1 << 20


def server_name(data_dir: Path | None = None) -> str:
    """The local server's name for this user's data folder (short: Unix sockets cap paths)."""
    folder = os.path.normcase(os.path.abspath(data_dir or paths.data_dir()))
    return "CheckpointChat-" + hashlib.sha256(folder.encode("utf-8")).hexdigest()[:16]


def hand_over(files: list, name: str | None = None, timeout_ms: int = HAND_OVER_TIMEOUT_MS,
              answer_timeout_ms: int = ANSWER_TIMEOUT_MS) -> bool:
    """Give ``files`` to the instance already running; False when there is none.

    Needs a QCoreApplication (the app's own, created before the window).
    """
    socket = QLocalSocket()
    socket.connectToServer(name or server_name())
    if not socket.waitForConnected(timeout_ms):
        return False
    message = json.dumps([str(Path(f).resolve()) for f in files]).encode("utf-8") + b"\n"
    socket.write(message)
    deadline = QDeadlineTimer(answer_timeout_ms)
    socket.waitForBytesWritten(answer_timeout_ms)
    answer = b""
    while b"\n" not in answer and not deadline.hasExpired() \
            and socket.waitForReadyRead(max(1, deadline.remainingTime())):
        answer += socket.readAll().data()
    socket.disconnectFromServer()
    if not answer.startswith(b"ok"):
        log.warning("the running Checkpoint Chat did not take the files (%r)", answer[:40])
        return False
    return True


class InstanceServer(QObject):
    """Listens for later starts of the app and emits the files they hand over.

    Signals:
        files_received(list): paths (str) a later start was asked to open.
    """

    files_received = Signal(list)

    def __init__(self, name: str | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.name = name or server_name()
        self._server = QLocalServer(self)
        self._server.newConnection.connect(self._on_server_new_connection)
        self._buffers: dict[QLocalSocket, bytes] = {}

    def listen(self) -> bool:
        """Start listening; False (logged) when another instance got there first."""
        # a Unix socket file left by a crashed instance would make listen() fail; nobody
        # answered hand_over() on it, so it is stale (a no-op on Windows' named pipes)
        QLocalServer.removeServer(self.name)
        if not self._server.listen(self.name):
            log.warning("single-instance server %s not started: %s", self.name, self._server.errorString())
            return False
        return True

    def close(self) -> None:
        self._server.close()

    @Slot()
    def _on_server_new_connection(self) -> None:
        while self._server.hasPendingConnections():
            socket = self._server.nextPendingConnection()
            self._buffers[socket] = b""
            socket.readyRead.connect(lambda s=socket: self._on_socket_ready_read(s))
            socket.disconnected.connect(lambda s=socket: self._forget(s))

    def _forget(self, socket: QLocalSocket) -> None:
        self._buffers.pop(socket, None)
        socket.deleteLater()

    def _on_socket_ready_read(self, socket: QLocalSocket) -> None:
        data = self._buffers.get(socket, b"") + socket.readAll().data()
        if b"\n" not in data:
            self._buffers[socket] = data[-_MAX_MESSAGE:]
            return
        line = data.split(b"\n", 1)[0]
        try:
            files = [str(f) for f in json.loads(line.decode("utf-8"))]
        except (ValueError, TypeError) as exc:
            log.warning("ignored a malformed hand-over: %s", exc)
            socket.disconnectFromServer()
            return
        socket.write(b"ok\n")
        socket.flush()
        log.info("a later start handed over %d file(s)", len(files))
        self.files_received.emit(files)


def bring_forward(window, files: list) -> None:
    """The running window opens what a later start was given, and comes to the front."""
    if files:
        window.import_files([Path(f) for f in files])
    window.showNormal()
    window.raise_()
    window.activateWindow()
