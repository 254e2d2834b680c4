"""The window's "Local server" switch: the OpenAI-compatible server on the app's own loop.

:class:`LocalServerSwitch` starts :class:`engine.server.app.LocalServer` on the qasync
loop the app already runs, with the window's own engine worker (the server is one more
listener of it), so a conversation a client sends appears in the list and can be
continued in the window, and the window's answers and the clients' queue on the one
engine thread.  It listens on 127.0.0.1 only (other machines: ``checkpoint-chat serve
--host ... --api-key ...``); its address is shown in the status bar.  A port that is
taken is told once with show_error and the switch stays on, to be retried when the
settings change.

Signals:
    address_changed(str): the URL it listens on, "" when stopped.
"""

from __future__ import annotations

import asyncio
import logging

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import QLabel

from engine.server.app import LocalServer, ServerOptions
from gui.tasks import spawn

log = logging.getLogger("gui")


class LocalServerSwitch(QObject):
    address_changed = Signal(str)

    def __init__(self, window) -> None:
        super().__init__(window)
        self.window = window
        self.server: LocalServer | None = None
        self._lock = asyncio.Lock()
        self._pending = 0          # applies and stops spawned, not finished
        self.label = QLabel("", window)
        self.label.setObjectName("localServer")
        self.label.setAccessibleName("Local server address")
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.label.hide()
        window.statusBar().addPermanentWidget(self.label)

    @property
    def url(self) -> str:
        return self.server.url if self.server is not None and self.server.url else ""

    def apply(self) -> asyncio.Future | None:
        """Start, restart (another port) or stop the server as the settings say."""
        if not self.window.settings.local_server and self.server is None and not self._pending:
            return None   # off and stopped: nothing to do (and no loop needed)
        self._pending += 1
        return spawn(self._apply())

    def stop(self) -> asyncio.Future | None:
        if self.server is None and not self._pending:
            return None
        self._pending += 1
        return spawn(self._stop())

    async def _apply(self) -> None:
        try:
            async with self._lock:
                await self._apply_locked()
        finally:
            self._pending -= 1

    async def _apply_locked(self) -> None:
        s = self.window.settings
        closing = getattr(self.window, "_closing", False)
        want, port = bool(s.local_server) and not closing, max(0, s.local_server_port)
        if self.server is not None and (not want or self.server.options.port != port):
            await self._stop_locked()
        if not want or self.server is not None:
            return
        server = LocalServer(self.window.worker, ServerOptions(host="127.0.0.1", port=port))
        try:
            url = await server.start()
        except OSError as exc:
            self.window.show_error("Local server", f"The local server could not listen on "
                                   f"127.0.0.1:{port}: {exc.strerror or exc}. Choose another port in "
                                   "Settings.")
            return
        self.server = server
        log.info("local server listening on %s", url)
        self.label.setText(f"Server: {url}/v1")
        self.label.setToolTip("OpenAI-compatible API of the loaded model (this machine only); "
                              "Settings › Local server turns it off")
        self.label.show()
        self.address_changed.emit(url)

    async def _stop(self) -> None:
        try:
            async with self._lock:
                await self._stop_locked()
        finally:
            self._pending -= 1

    async def _stop_locked(self) -> None:
        server, self.server = self.server, None
        if server is None:
            return
        self.label.hide()
        self.address_changed.emit("")
        await server.stop()
