"""Stand-ins for kernel32 and user32, for the Windows paths of engine/shutdown.py on Linux.

:class:`FakeUser32` keeps one message queue, as the window's thread has one: ``send``
plays the part of Windows sending WM_QUERYENDSESSION / WM_ENDSESSION (it waits for
the window procedure's answer, as SendMessage does), and the window procedure is
called through C, from the pointer the code registered with RegisterClassExW.
"""

from __future__ import annotations

import ctypes
import queue

from engine.shutdown import WM_DESTROY

WNDPROC = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_uint,
                           ctypes.c_size_t, ctypes.c_ssize_t)
HWND = 0x1234
WS_VISIBLE = 0x10000000


class FakeKernel32:
    def __init__(self, ok: bool = True) -> None:
        self.ok = ok
        self.calls: list[tuple[object, int]] = []

    def SetConsoleCtrlHandler(self, routine, add):  # noqa: N802 - Windows' names
        self.calls.append((routine, add))
        return 1 if self.ok else 0

    def GetModuleHandleW(self, name):  # noqa: N802
        return 0x400000

    @property
    def routine(self):
        return self.calls[-1][0]


class FakeUser32:
    def __init__(self, create_ok: bool = True) -> None:
        self.create_ok = create_ok
        self.messages: queue.Queue = queue.Queue()
        self.registered: list = []
        self.created: list[dict] = []
        self.destroyed: list[int] = []
        self.unregistered: list[str] = []
        self.proc = None
        self._reply = None

    # -- what the code calls --------------------------------------------------------------------
    def RegisterClassExW(self, ref):  # noqa: N802
        wc = ref._obj
        self.registered.append((wc.lpszClassName, wc.lpfnWndProc, wc.cbSize))
        self.proc = ctypes.cast(wc.lpfnWndProc, WNDPROC)
        return 0xC001

    def UnregisterClassW(self, name, instance):  # noqa: N802
        self.unregistered.append(name)
        return 1

    def CreateWindowExW(self, ex_style, cls, title, style, x, y, w, h, parent, menu, inst, param):  # noqa: N802
        self.created.append(dict(ex_style=ex_style, cls=cls, style=style, parent=parent,
                                 instance=inst))
        return HWND if self.create_ok else None

    def GetMessageW(self, ref, hwnd, low, high):  # noqa: N802
        item = self.messages.get()
        if item is None:                      # WM_QUIT
            return 0
        msg = ref._obj
        msg.hwnd, (msg.message, msg.wParam, msg.lParam, self._reply) = HWND, item
        return 1

    def TranslateMessage(self, ref):  # noqa: N802
        return 0

    def DispatchMessageW(self, ref):  # noqa: N802
        msg, reply = ref._obj, self._reply
        result = self.proc(msg.hwnd, msg.message, msg.wParam, msg.lParam)
        if reply is not None:
            reply.put(result)
        return result

    def PostMessageW(self, hwnd, message, wparam, lparam):  # noqa: N802
        self.messages.put((message, wparam, lparam, None))
        return 1

    def DestroyWindow(self, hwnd):  # noqa: N802
        self.destroyed.append(hwnd)
        self.proc(hwnd, WM_DESTROY, 0, 0)     # Windows sends WM_DESTROY before returning
        return 1

    def PostQuitMessage(self, code):  # noqa: N802
        self.messages.put(None)

    def DefWindowProcW(self, hwnd, message, wparam, lparam):  # noqa: N802
        return 0

    # -- what Windows does ------------------------------------------------------------------------
    def send(self, message: int, wparam: int = 0, lparam: int = 0, timeout: float = 30) -> int:
        """SendMessage from another thread: waits until the window procedure answered."""
        reply: queue.Queue = queue.Queue()
        self.messages.put((message, wparam, lparam, reply))
        return reply.get(timeout=timeout)
