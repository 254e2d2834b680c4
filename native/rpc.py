"""Remote workers: llama.cpp's RPC backend (``ggml-rpc``) through ctypes.

A *worker* is a process that serves one of its devices (CPU or a GPU) to other
machines: :func:`serve` calls llama.cpp's ``ggml_backend_rpc_start_server``.  A
*client* registers each worker with ``ggml_backend_rpc_add_server`` and passes the
devices it gets in ``llama_model_params.devices``; ``n_gpu_layers`` then puts that many
layers, and their KV cells, on the workers.  The wire format is llama.cpp's own; what
travels is model weights, activations and KV cells, unauthenticated and unencrypted.

Every function is reached through the backend registry (``ggml_backend_reg_by_name
("RPC")`` and ``ggml_backend_reg_get_proc_address``), so a library built with the RPC
backend linked in and one that loads it as a plug-in both work; one built without it is
told in a plain sentence (:func:`rpc_problem`).

What llama.cpp does on faults, and what this module adds (measured with this build,
commit 0c1e57098, RPC protocol 7.0.0):

- A malformed endpoint or a port nobody listens on: llama.cpp calls ``GGML_ABORT``
  ("Failed to parse endpoint", "Failed to connect") and the process ends.  Here
  :func:`parse_endpoint` and :func:`hello` refuse it first, in one sentence.
- A worker of another protocol version: abort ("RPC handshake failed").  :func:`hello`
  reads the version first and names both.
- A host that drops packets: llama.cpp's ``connect`` waits as long as the OS does
  (about two minutes).  :func:`hello` connects with ``connect_timeout``.
- A worker busy with another client, or hung, before the model loads: llama.cpp waits
  for ever in the handshake.  :func:`hello` gives up after ``connect_timeout``.
- A worker that dies while in use (loading, prefill, generation, a save, freeing):
  ``RPC_STATUS_ASSERT`` aborts on llama.cpp's dispatcher thread.
  :func:`native.rpc_guard.install_abort_handler` turns that into one sentence naming
  the worker (on stderr, and as the first line of the crash trace the next start
  reads), then exit status 1.
- A worker that hangs while in use: llama.cpp waits for ever (its sockets have no
  timeout).  :class:`native.rpc_guard.SocketGuard` sets receive/send timeouts on
  llama.cpp's sockets to the workers, so after ``io_timeout`` it is a transport
  error, reported as above.

The abort cannot be turned into an exception: ggml calls ``abort()`` right after the
callback returns, and the callback runs on llama.cpp's dispatcher thread while the
caller waits for it.  What is lost is the answer since the last autosave; checkpoints
are written atomically and never depend on where the KV cells lived.

The pre-flight :func:`hello` speaks only the protocol's handshake (command 14: 24
bytes of connection capabilities out, version and capabilities back) and its device
count (command 15), then closes; llama.cpp makes its own connection afterwards.  A
worker serves one client at a time, so a worker busy with another client answers the
handshake only when that client leaves.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from native.endpoint import Endpoint
from native.errors import NativeError
from native.library import bindings, loaded_library
from native.rpc_guard import IO_TIMEOUT_S, SocketGuard, install_abort_handler

log = logging.getLogger("native")

#: RPC_PROTO_{MAJOR,MINOR,PATCH}_VERSION in ggml-rpc.h of the llama.cpp this app needs.
PROTOCOL = (7, 0, 0)
DEFAULT_PORT = 50052
#: Seconds for the pre-flight connect and handshake.
CONNECT_TIMEOUT_S = 5.0

_CMD_HELLO, _CMD_DEVICE_COUNT = 14, 15
_CONN_CAPS = 24                         # RPC_CONN_CAPS_SIZE: zeros ask for plain TCP
_MAX_SERVERS = 16                       # GGML_RPC_MAX_SERVERS
_DEVICE_TYPE_CPU, _DEVICE_TYPE_GPU, _DEVICE_TYPE_IGPU = 0, 1, 2


class RpcError(NativeError):
    """A remote worker cannot be used: the sentence names it and says why."""


# -- endpoints ----------------------------------------------------------------------------------

def parse_endpoint(text: str) -> Endpoint:
    """``HOST:PORT`` as llama.cpp reads it (the first colon splits), checked first."""
    raw = text.strip()
    example = f"e.g. 192.168.1.20:{DEFAULT_PORT}"
    host, sep, port = raw.partition(":")
    if not sep or not host or not port:
        raise RpcError(f"malformed worker address '{raw}': expected HOST:PORT, {example}")
    if ":" in port or host.startswith("["):
        raise RpcError(f"malformed worker address '{raw}': llama.cpp's RPC takes a host name or "
                       f"an IPv4 address, not IPv6 ({example})")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise RpcError(f"malformed worker address '{raw}': the port must be a number from 1 to "
                       f"65535 ({example})")
    if any(c.isspace() for c in host):
        raise RpcError(f"malformed worker address '{raw}': a host name has no spaces ({example})")
    return Endpoint(host, int(port))


def parse_endpoints(spec: str | Iterable[str]) -> tuple[Endpoint, ...]:
    """Worker addresses from ``"a:1,b:2"`` (commas or spaces) or a list; no duplicates."""
    items = spec.replace(",", " ").split() if isinstance(spec, str) else [s for s in spec if s.strip()]
    endpoints = tuple(parse_endpoint(item) for item in items)
    seen = set()
    for ep in endpoints:
        if str(ep) in seen:
            raise RpcError(f"the worker {ep} is listed twice")
        seen.add(str(ep))
    if len(endpoints) > _MAX_SERVERS:
        raise RpcError(f"llama.cpp's RPC takes at most {_MAX_SERVERS} workers, not {len(endpoints)}")
    return endpoints


# -- the pre-flight handshake --------------------------------------------------------------------

@dataclass(frozen=True)
class Hello:
    endpoint: Endpoint
    version: tuple[int, int, int]
    n_devices: int


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionAbortedError("closed")
        data += chunk
    return data


def _request(sock: socket.socket, cmd: int, payload: bytes) -> bytes:
    sock.sendall(bytes([cmd]) + struct.pack("<Q", len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
    if size > 4096:
        raise ValueError(f"answer of {size} bytes")
    return _recv_exact(sock, size)


def version_problem(endpoint: Endpoint, version: tuple[int, int, int]) -> str | None:
    """llama.cpp's own rule (client side of the handshake): same major, minor not newer."""
    major, minor, _patch = version
    if major == PROTOCOL[0] and minor <= PROTOCOL[1]:
        return None
    return (f"the worker {endpoint} speaks llama.cpp RPC protocol {'.'.join(map(str, version))}, "
            f"this app's llama.cpp speaks {'.'.join(map(str, PROTOCOL))}: run a worker built from "
            f"the same llama.cpp (`checkpoint-chat rpc-worker` of this app)")


def hello(endpoint: Endpoint, timeout: float = CONNECT_TIMEOUT_S) -> Hello:
    """Connect, handshake and count devices within ``timeout`` seconds, or say why not."""
    where = f"the worker {endpoint}"
    try:
        infos = socket.getaddrinfo(endpoint.host, endpoint.port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        raise RpcError(f"{where}: cannot resolve the host name '{endpoint.host}'") from None
    try:
        host, port = infos[0][4][:2]                   # AF_INET: (host, port)
        sock = socket.create_connection((str(host), int(port)), timeout=timeout)
    except ConnectionRefusedError:
        raise RpcError(f"nothing listens on {endpoint} (start `checkpoint-chat rpc-worker --port "
                       f"{endpoint.port}` there, and check its --host)") from None
    except TimeoutError:
        raise RpcError(f"{where} did not accept a connection within {timeout:g} s (host down, "
                       "or a firewall drops the port)") from None
    except OSError as exc:
        raise RpcError(f"{where} cannot be reached: {exc.strerror or exc}") from None
    with sock:
        try:
            answer = _request(sock, _CMD_HELLO, bytes(_CONN_CAPS))
            if len(answer) < 3:
                raise ValueError("short answer")
            version = (answer[0], answer[1], answer[2])
            problem = version_problem(endpoint, version)
            if problem:
                raise RpcError(problem)
            count = _request(sock, _CMD_DEVICE_COUNT, b"")
            n_devices = struct.unpack("<I", count)[0] if len(count) == 4 else 0
        except TimeoutError:
            raise RpcError(f"{where} accepted the connection but did not answer within {timeout:g} s "
                           "(it is serving another client, or it hangs)") from None
        except (ConnectionError, ValueError, struct.error):
            raise RpcError(f"{where} broke off the handshake: not a llama.cpp RPC worker of protocol "
                           f"{'.'.join(map(str, PROTOCOL))} (a worker built from another llama.cpp, "
                           "or another program on that port)") from None
        except OSError as exc:
            raise RpcError(f"{where} failed during the handshake: {exc.strerror or exc}") from None
    if n_devices == 0:
        raise RpcError(f"{where} offers no device")
    return Hello(endpoint, version, n_devices)


# -- llama.cpp's RPC functions ---------------------------------------------------------------------

class _Backend:
    """The registry and RPC entry points, bound from the library already in this process."""

    def __init__(self, lib, reg: int) -> None:
        self.reg = reg
        get_proc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
            ("ggml_backend_reg_get_proc_address", lib))

        def proc(name: str, proto):
            # void * ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name)
            address = get_proc(reg, name.encode())
            return proto(address) if address else None

        # ggml_backend_reg_t ggml_backend_rpc_add_server(const char * endpoint)
        self.add_server = proc("ggml_backend_rpc_add_server",
                               ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p))
        # void ggml_backend_rpc_start_server(const char * endpoint, const char * cache_dir,
        #                                    size_t n_threads, size_t n_devices, ggml_backend_dev_t * devices)
        self.start_server = proc("ggml_backend_rpc_start_server",
                                 ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                                  ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)))

        def fn(name: str, restype, *argtypes):
            return ctypes.CFUNCTYPE(restype, *argtypes)((name, lib))

        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        self.reg_dev_count = fn("ggml_backend_reg_dev_count", sz, vp)   # (ggml_backend_reg_t reg)
        self.reg_dev_get = fn("ggml_backend_reg_dev_get", vp, vp, sz)    # (reg, size_t index)
        self.dev_count = fn("ggml_backend_dev_count", sz)                # (void)
        self.dev_get = fn("ggml_backend_dev_get", vp, sz)                # (size_t index)
        self.dev_by_name = fn("ggml_backend_dev_by_name", vp, ctypes.c_char_p)
        self.dev_name = fn("ggml_backend_dev_name", ctypes.c_char_p, vp)
        self.dev_description = fn("ggml_backend_dev_description", ctypes.c_char_p, vp)
        self.dev_type = fn("ggml_backend_dev_type", ctypes.c_int, vp)
        # void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total)
        self.dev_memory = fn("ggml_backend_dev_memory", None, vp, ctypes.POINTER(sz), ctypes.POINTER(sz))
        # ggml_abort_callback_t ggml_set_abort_callback(ggml_abort_callback_t callback)
        self.abort_callback_type = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
        self.set_abort_callback = fn("ggml_set_abort_callback", vp, self.abort_callback_type)

    def memory(self, dev: int) -> tuple[int, int]:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self.dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    def text(self, raw: bytes | None) -> str:
        return (raw or b"").decode("utf-8", "replace")


_backend: _Backend | None = None
_backend_problem: str | None = None
_backend_lock = threading.Lock()


def _ggml_handles(ll: ModuleType, folder: Path) -> list:
    """Where ggml's functions are: through libllama's own handle first (dlsym searches its
    dependencies, so these are the very copies llama.cpp uses; the wheel's libggml.so and
    libggml.so.0 are separate files, so opening one by file name could map a second copy
    with its own registry), else the files beside it (Windows: the same DLL by name)."""
    handles = [ll._lib]
    names = {"win32": ("ggml.dll", "ggml-base.dll"), "darwin": ("libggml.dylib", "libggml-base.dylib")}
    for name in names.get(sys.platform, ("libggml.so.0", "libggml-base.so.0")):
        if (folder / name).is_file():
            try:
                handles.append(ctypes.CDLL(str(folder / name)))
            except OSError:
                pass
    return handles


def backend() -> _Backend:
    """llama.cpp's RPC backend in the loaded library, or :class:`RpcError` saying plainly why not."""
    global _backend, _backend_problem
    ll = bindings()
    with _backend_lock:
        if _backend is not None:
            return _backend
        if _backend_problem is None:
            lib = loaded_library()
            _backend_problem = _find_backend(ll, lib.folder, lib.path)
        if _backend_problem:
            raise RpcError(_backend_problem)
        assert _backend is not None
        return _backend


def _find_backend(ll: ModuleType, folder: Path, path: Path) -> str | None:
    global _backend
    remedy = ("choose a llama.cpp build that has it (-DGGML_RPC=ON) as the llama library folder "
              "(Settings, --llama-lib)" if getattr(sys, "frozen", False) else   # (the installed app: no pip)
              "rebuild llama-cpp-python with -DGGML_RPC=ON in CMAKE_ARGS and pip's --no-cache-dir "
              "(its wheel cache ignores CMAKE_ARGS), see the README")
    missing = (f"the llama library {path} was built without llama.cpp's RPC backend, so remote "
               f"workers cannot be used; {remedy}")
    for lib in _ggml_handles(ll, folder):
        try:
            by_name = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(("ggml_backend_reg_by_name", lib))
            reg = by_name(b"RPC")
            if not reg:
                return missing
            found = _Backend(lib, reg)
        except AttributeError:
            continue
        if found.add_server is None or found.start_server is None:
            return missing
        _backend = found
        return None
    return missing


def rpc_problem() -> str | None:
    """None when the loaded library has the RPC backend, else the sentence saying so."""
    try:
        backend()
    except RpcError as exc:
        return str(exc)
    return None


# -- devices --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Device:
    """A device of this machine or of a worker, as llama.cpp names it."""
    name: str               # "CPU", "CUDA0"; "RPC0" for a worker's
    description: str        # a worker's is its endpoint
    kind: str               # "CPU", "GPU", "iGPU", "accelerator"; a worker's always reads GPU
    ptr: int = 0
    endpoint: Endpoint | None = None


_KINDS = {0: "CPU", 1: "GPU", 2: "iGPU", 3: "accelerator"}


def local_devices() -> list[Device]:
    """The devices of this machine (the registry holds no worker: they are never registered)."""
    b = backend()
    out = []
    for i in range(b.dev_count()):
        dev = b.dev_get(i)
        out.append(Device(b.text(b.dev_name(dev)), b.text(b.dev_description(dev)),
                          _KINDS.get(b.dev_type(dev), "other"), dev))
    return out


def device_memory(device: Device) -> tuple[int, int]:
    """(free, total) bytes; a worker's is asked over the network (guard it: SocketGuard)."""
    return backend().memory(device.ptr)


# -- remote workers ---------------------------------------------------------------------------------

class Workers:
    """The workers a model's layers go to: checked, registered with llama.cpp, guarded.

    Build it with :meth:`connect` right before loading the model, after any model that
    used the same workers was closed (a worker serves one client at a time: our own open
    connection would make the handshake wait).
    """

    def __init__(self, endpoints: Sequence[Endpoint], devices: Sequence[Device], *,
                 io_timeout: float = IO_TIMEOUT_S) -> None:
        self.endpoints = tuple(endpoints)
        self.devices = tuple(devices)
        self.io_timeout = io_timeout

    @classmethod
    def connect(cls, spec: str | Iterable[str], *, io_timeout: float = IO_TIMEOUT_S,
                connect_timeout: float = CONNECT_TIMEOUT_S,
                crash_note: Path | None = None, message_prefix: str = "error: ") -> Workers:
        """Check every worker (bounded), then register them with llama.cpp.

        Installs the abort handler (:func:`install_abort_handler`) with ``crash_note``:
        from here on a worker lost in the middle of a llama.cpp call ends this process
        with one sentence and exit status 1.
        """
        endpoints = parse_endpoints(spec)
        if not endpoints:
            raise RpcError("no worker address given")
        if io_timeout <= 0:
            raise RpcError(f"the worker timeout must be a positive number of seconds, not {io_timeout:g}")
        b = backend()
        hellos = [hello(ep, connect_timeout) for ep in endpoints]   # all of them before llama.cpp
        install_abort_handler(b, endpoints, io_timeout=io_timeout, crash_note=crash_note,
                              message_prefix=message_prefix)
        devices: list[Device] = []
        for h in hellos:
            with SocketGuard([h.endpoint], io_timeout) as guard, guard.watching():
                reg = b.add_server(str(h.endpoint).encode())
            if not reg:
                raise RpcError(f"the worker {h.endpoint} offers no device")
            n = b.reg_dev_count(reg)
            if n != h.n_devices:
                raise RpcError(f"the worker {h.endpoint} now offers {h.n_devices} device(s), not the "
                               f"{n} llama.cpp registered earlier in this process: restart the app")
            for i in range(n):
                dev = b.reg_dev_get(reg, i)
                devices.append(Device(b.text(b.dev_name(dev)), str(h.endpoint), "GPU", dev, h.endpoint))
        return cls(endpoints, devices, io_timeout=io_timeout)

    def memory(self) -> list[tuple[Device, int, int]]:
        """Each remote device with its free and total bytes (a short connection each)."""
        out = []
        with SocketGuard(self.endpoints, self.io_timeout) as guard, guard.watching():
            for dev in self.devices:
                out.append((dev, *device_memory(dev)))
        return out

    def guard(self) -> SocketGuard:
        return SocketGuard(self.endpoints, self.io_timeout)

    def __str__(self) -> str:
        return ", ".join(map(str, self.endpoints))


# -- where the layers go ---------------------------------------------------------------------------

def layer_plan(n_layer: int, n_gpu_layers: int, weights: Sequence[float]) -> list[int]:
    """Layers per device (``weights`` order) and, last, on this machine's CPU.

    The same rule as llama.cpp's ``load_tensors`` with an explicit ``tensor_split``: the
    last ``n_gpu_layers`` of the ``n_layer + 1`` slots (the output layer is the last one)
    go to the devices, split by cumulative weight; negative means all.
    """
    slots = n_layer + 1
    ngl = slots if n_gpu_layers < 0 else n_gpu_layers
    counts = [0] * (len(weights) + 1)
    if not weights or sum(weights) <= 0:
        counts[-1] = slots
        return counts
    total, running, bounds = float(sum(weights)), 0.0, []
    for w in weights:
        running += w
        bounds.append(ctypes.c_float(running / total).value)   # llama.cpp keeps them as float
    start = max(slots - ngl, 0)
    active = min(ngl, slots)
    for il in range(slots):
        if il < start or il - start >= active:
            counts[-1] += 1
            continue
        x = ctypes.c_float((il - start) / active).value
        index = next((i for i, b in enumerate(bounds) if b > x), len(bounds) - 1)   # upper_bound
        counts[index] += 1
    return counts


def describe_plan(counts: Sequence[int], devices: Sequence[Device]) -> str:
    """Where the layers are, for a status bar: "layers: 16 on 127.0.0.1:50052, 15 on
    127.0.0.1:50053" or "layers: 10 on 127.0.0.1:50052, 21 on this machine"."""
    parts = [f"{n} on {dev.description if dev.endpoint else dev.name}"
             for n, dev in zip(counts, devices, strict=False) if n]   # counts' last: this machine
    if counts[-1]:
        parts.append(f"{counts[-1]} on this machine")
    return "layers: " + ", ".join(parts)


# -- serving: the worker side -----------------------------------------------------------------------

def pick_devices(names: Sequence[str] | None) -> list[Device]:
    """The local devices a worker serves: those named, else every GPU, else the CPU."""
    devices = local_devices()
    if names:
        chosen = []
        for name in names:
            match = next((d for d in devices if d.name.lower() == name.lower()), None)
            if match is None:
                listing = ", ".join(d.name for d in devices) or "none"
                raise RpcError(f"no device named {name} here; this machine has: {listing}")
            chosen.append(match)
        return chosen
    gpus = [d for d in devices if d.kind in ("GPU", "iGPU")]
    cpus = [d for d in devices if d.kind == "CPU"]
    if gpus or cpus:
        return gpus or cpus[:1]
    raise RpcError("llama.cpp sees no device on this machine to serve")


def port_problem(endpoint: Endpoint) -> str | None:
    """Why a worker could not listen on ``endpoint`` (tried with a socket of our own), or None."""
    try:
        infos = socket.getaddrinfo(endpoint.host, endpoint.port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return f"cannot resolve the host name '{endpoint.host}' to listen on"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        if os.name == "nt":
            sock.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_EXCLUSIVEADDRUSE", socket.SO_REUSEADDR), 1)
        else:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as llama.cpp does
        try:
            sock.bind(infos[0][4])
        except OSError as exc:
            if exc.errno in (98, 48, 10048):     # EADDRINUSE on Linux, macOS, Windows
                return (f"the port {endpoint.port} on {endpoint.host} is in use (another worker?); "
                        "choose one with --port")
            return f"cannot listen on {endpoint}: {exc.strerror or exc}"
    return None


def _short_path_name(path: str) -> str | None:
    """The 8.3 short name of an existing ``path`` (Windows), or None."""
    if sys.platform != "win32":
        return None
    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
    # DWORD GetShortPathNameW(LPCWSTR lpszLongPath, LPWSTR lpszShortPath, DWORD cchBuffer)
    get = kernel32.GetShortPathNameW
    get.argtypes = [ctypes.c_wchar_p, ctypes.c_wchar_p, ctypes.c_uint32]
    get.restype = ctypes.c_uint32
    size = get(path, None, 0)
    if size == 0:
        return None
    buf = ctypes.create_unicode_buffer(size)
    return buf.value if 0 < get(path, buf, size) < size else None


def cache_dir_argument(folder: Path, *, windows: bool = os.name == "nt",
                       short_path: Callable[[str], str | None] | None = None,
                       ansi: str = "mbcs") -> tuple[bytes, str | None]:
    """The ``const char *`` to give llama.cpp's RPC server for the weights cache ``folder``,
    and a note for the user when it is not the folder's own name.

    ggml-rpc.cpp makes a ``std::filesystem::path`` of it.  On POSIX that is the name's
    bytes (``os.fsencode``).  On Windows a narrow string is read in the ANSI code page
    (MSVC's ``std::filesystem``, which builds official releases and
    installer/build_cuda_llama.ps1), while ``os.fsencode`` gives UTF-8: a profile such as
    ``C:\\Users\\Zoë Müller`` became another folder, or none.  So on Windows: an ASCII name
    as it is; else the folder's 8.3 short name when that is ASCII (any build reads it the
    same way); else the name in the ANSI code page (``ansi``) when every letter has a byte
    there; else :class:`RpcError`, naming the folder and what to do.  ``folder`` exists.
    """
    if not windows:
        return os.fsencode(str(folder)), None
    name = str(folder)
    if name.isascii():
        return name.encode("ascii"), None
    short = (short_path or _short_path_name)(name)
    if short and short.isascii():
        return short.encode("ascii"), f"llama.cpp is given its short name {short}"
    try:
        return name.encode(ansi), None
    except UnicodeEncodeError:
        raise RpcError(f"llama.cpp cannot open the weights cache {name}: it reads the folder's name in "
                       "Windows' ANSI code page, which lacks some of its letters, and the folder has no "
                       "short (8.3) name. Choose a folder with a plain name (--cache C:\\rpc-cache) or "
                       "run without --cache.") from None


def serve(endpoint: Endpoint, devices: Sequence[Device], *, threads: int,
          cache_dir: Path | None = None) -> None:
    """Serve ``devices`` on ``endpoint`` until the process ends (llama.cpp's loop).

    Returns only when llama.cpp could not start serving (it printed why).  ``cache_dir``
    must exist; :func:`cache_dir_argument` may refuse it (RpcError).
    """
    b = backend()
    array = (ctypes.c_void_p * len(devices))(*[d.ptr for d in devices])
    cache = cache_dir_argument(cache_dir)[0] if cache_dir is not None else None
    b.start_server(str(endpoint).encode(), cache, threads, len(devices), array)


def wait_until_serving(endpoint: Endpoint, timeout: float) -> bool:
    """True once a worker answers the handshake on ``endpoint`` (polled), False at ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            hello(endpoint, min(2.0, max(0.1, deadline - time.monotonic())))
            return True
        except RpcError:
            time.sleep(0.05)
    return False


def main() -> int:
    """``python -m native.rpc``: exit 0 when the llama library has the RPC backend (install
    scripts rebuild llama-cpp-python when it does not), else say why and exit 1."""
    try:
        problem = rpc_problem()
    except NativeError as exc:
        problem = str(exc)
    print(f"llama.cpp RPC backend: {'yes' if problem is None else 'no: ' + problem}")
    return 0 if problem is None else 1


if __name__ == "__main__":
    sys.exit(main())
