"""Remote workers, the fast tier: addresses, the pre-flight handshake against fake
workers (refused, silent, another protocol, not a worker), the layer plan, the
sentences, and the command line's refusals (one line, exit 1, no traceback).

No llama.cpp RPC connection is made here (tests/test_rpc_loopback.py has real workers).
"""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time
import types

import pytest
from conftest import run_cli

from native import rpc, rpc_guard
from native.endpoint import Endpoint
from native.rpc import RpcError


def free_port() -> int:
    """A loopback port nobody listens on (just released by us)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli_quick(*args: str):
    return run_cli(*args, timeout=60)

# -- addresses ------------------------------------------------------------------------------------


def test_endpoints_parse_as_llama_cpp_reads_them():
    assert rpc.parse_endpoint(" 192.168.1.20:50052 ") == Endpoint("192.168.1.20", 50052)
    assert rpc.parse_endpoints("a:1, b:2 c:3") == (Endpoint("a", 1), Endpoint("b", 2), Endpoint("c", 3))
    assert rpc.parse_endpoints(["a:1", " "]) == (Endpoint("a", 1),)
    assert Endpoint("127.0.0.1", 1).is_loopback and Endpoint("localhost", 1).is_loopback
    assert not Endpoint("0.0.0.0", 1).is_loopback and not Endpoint("192.168.1.2", 1).is_loopback


@pytest.mark.parametrize("text, says", [
    ("nonsense", "expected HOST:PORT"),
    ("host:", "expected HOST:PORT"),
    (":50052", "expected HOST:PORT"),
    ("host:port", "port must be a number"),
    ("host:70000", "port must be a number"),
    ("host:0", "port must be a number"),
    ("[::1]:50052", "not IPv6"),
    ("fe80::1:50052", "not IPv6"),
])
def test_a_malformed_endpoint_is_one_sentence_naming_it(text, says):
    with pytest.raises(RpcError) as err:
        rpc.parse_endpoint(text)
    assert says in str(err.value) and text.strip() in str(err.value)


def test_a_worker_listed_twice_or_too_many_is_refused():
    with pytest.raises(RpcError, match="listed twice"):
        rpc.parse_endpoints("a:1,a:1")
    with pytest.raises(RpcError, match="at most 16"):
        rpc.parse_endpoints([f"h:{p}" for p in range(1, 18)])


# -- fake workers for the handshake -----------------------------------------------------------------

class FakeWorker:
    """A listening socket that answers the handshake the way ``behaviour`` says."""

    def __init__(self, behaviour: str, version=(7, 0, 0), devices: int = 1) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.endpoint = Endpoint("127.0.0.1", self.sock.getsockname()[1])
        self.behaviour, self.version, self.devices = behaviour, version, devices
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            if self.behaviour == "silent":
                time.sleep(3)
                return
            head = conn.recv(9)
            if self.behaviour == "close" or len(head) < 9:
                return
            size = struct.unpack("<Q", head[1:])[0]
            while size > 0:
                size -= len(conn.recv(size))
            answer = bytes(self.version) + bytes(1 + 24)
            conn.sendall(struct.pack("<Q", len(answer)) + answer)
            head = conn.recv(9)
            count = struct.pack("<I", self.devices)
            conn.sendall(struct.pack("<Q", len(count)) + count)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def fake():
    made = []

    def make(*args, **kwargs):
        made.append(FakeWorker(*args, **kwargs))
        return made[-1]

    yield make
    for worker in made:
        worker.close()


def test_the_handshake_reads_version_and_devices(fake):
    w = fake("ok", devices=2)
    h = rpc.hello(w.endpoint, timeout=2)
    assert h.version == (7, 0, 0) and h.n_devices == 2


def test_nobody_listening_is_said_at_once():
    ep = Endpoint("127.0.0.1", free_port())
    started = time.monotonic()
    with pytest.raises(RpcError, match=f"nothing listens on {ep}"):
        rpc.hello(ep, timeout=2)
    assert time.monotonic() - started < 1


def test_a_silent_worker_costs_the_timeout_not_more(fake):
    w = fake("silent")
    started = time.monotonic()
    with pytest.raises(RpcError, match="did not answer within 0.5 s"):
        rpc.hello(w.endpoint, timeout=0.5)
    assert time.monotonic() - started < 1.5


@pytest.mark.parametrize("version", [(6, 0, 0), (8, 0, 0), (7, 9, 0)])
def test_another_protocol_version_is_named(fake, version):
    w = fake("ok", version=version)
    with pytest.raises(RpcError) as err:
        rpc.hello(w.endpoint, timeout=2)
    text = str(err.value)
    assert f"{'.'.join(map(str, version))}" in text and "7.0.0" in text and str(w.endpoint) in text


def test_a_newer_patch_or_older_minor_is_accepted():
    assert rpc.version_problem(Endpoint("h", 1), (7, 0, 5)) is None


def test_something_else_on_the_port_is_not_a_worker(fake):
    w = fake("close")
    with pytest.raises(RpcError, match="not a llama.cpp RPC worker of protocol 7.0.0"):
        rpc.hello(w.endpoint, timeout=2)


def test_a_worker_without_devices_is_refused(fake):
    w = fake("ok", devices=0)
    with pytest.raises(RpcError, match="offers no device"):
        rpc.hello(w.endpoint, timeout=2)


def test_an_unresolvable_host_is_named():
    with pytest.raises(RpcError, match="cannot resolve the host name 'no-such-host.invalid'"):
        rpc.hello(Endpoint("no-such-host.invalid", 50052), timeout=2)


# -- the layer plan (llama.cpp's rule, checked against its own log in the loopback tier) ------------

def test_layer_plan_follows_llama_cpps_split():
    assert rpc.layer_plan(30, -1, [1.0]) == [31, 0]
    assert rpc.layer_plan(30, 0, [1.0]) == [0, 31]
    assert rpc.layer_plan(30, 10, [1.0]) == [10, 21]
    assert rpc.layer_plan(30, 99, [1.0, 1.0]) == [16, 15, 0]
    assert rpc.layer_plan(30, -1, [3.0, 1.0]) == [24, 7, 0]
    assert sum(rpc.layer_plan(47, 20, [5.0, 2.0, 1.0])) == 48
    assert rpc.layer_plan(30, -1, []) == [31]


def test_placement_text_names_the_workers():
    devs = [rpc.Device("RPC0", "10.0.0.2:50052", "GPU", 1, Endpoint("10.0.0.2", 50052)),
            rpc.Device("RPC1", "10.0.0.3:50052", "GPU", 2, Endpoint("10.0.0.3", 50052))]
    assert rpc.describe_plan([16, 15, 0], devs) == "layers: 16 on 10.0.0.2:50052, 15 on 10.0.0.3:50052"
    assert rpc.describe_plan([10, 0, 21], devs) == "layers: 10 on 10.0.0.2:50052, 21 on this machine"


# -- what the user reads when llama.cpp gives up ---------------------------------------------------------

def test_lost_worker_sentences():
    a, b = Endpoint("10.0.0.2", 50052), Endpoint("10.0.0.3", 50052)
    crashed = "ggml-rpc.cpp:566: Remote RPC server crashed or returned malformed response"
    assert rpc_guard.lost_worker_sentence(crashed, [a], 120, closed=[a]).startswith(
        "the remote worker 10.0.0.2:50052 closed the connection (stopped or crashed); llama.cpp cannot")
    assert rpc_guard.lost_worker_sentence(crashed, [a], 120).startswith(
        "the remote worker 10.0.0.2:50052 stopped answering (no reply within 120 s")
    assert rpc_guard.lost_worker_sentence(crashed, [a, b], 3).startswith(
        "one of the remote workers 10.0.0.2:50052, 10.0.0.3:50052 stopped answering")
    assert rpc_guard.lost_worker_sentence("ggml-rpc.cpp:547: Failed to connect to 10.0.0.3:50052", [a, b], 3) \
        .startswith("the remote worker 10.0.0.3:50052 could not be reached")
    for text in (rpc_guard.lost_worker_sentence(crashed, [a], 1),):
        assert "\n" not in text and "checkpoints are kept" in text


def test_a_library_without_the_rpc_backend_is_said_plainly(tmp_path, monkeypatch):
    import ctypes
    fake_ll = types.SimpleNamespace(_lib=ctypes.CDLL(None))   # the interpreter: no ggml inside
    problem = rpc._find_backend(fake_ll, tmp_path, tmp_path / "libllama.so")
    assert "was built without llama.cpp's RPC backend" in problem
    assert "-DGGML_RPC=ON" in problem and "--no-cache-dir" in problem
    # the installed (frozen) app has no pip to rebuild with: the remedy is another library
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    problem = rpc._find_backend(fake_ll, tmp_path, tmp_path / "llama.dll")
    assert "--llama-lib" in problem and "pip" not in problem and "--no-cache-dir" not in problem


def test_the_bundled_library_has_the_rpc_backend():
    assert rpc.rpc_problem() is None


def test_the_socket_guard_times_out_a_silent_peer(fake):
    """The guard's socket options reach a descriptor it did not open (as llama.cpp's)."""
    w = fake("silent")
    raw = socket.create_connection((w.endpoint.host, w.endpoint.port))   # "llama.cpp's" socket
    try:
        guard = rpc_guard.SocketGuard([w.endpoint], timeout=0.3)
        assert guard.apply() == 1
        started = time.monotonic()
        with pytest.raises(OSError):        # EAGAIN: what llama.cpp's recv sees
            raw.recv(8)
        assert time.monotonic() - started < 1.5
    finally:
        raw.close()


# -- the command line --------------------------------------------------------------------------------------

def _one_error_line(done, *needles):
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def test_cli_malformed_endpoint():
    _one_error_line(run_cli_quick("run", "--rpc", "nonsense", "-p", "hi", "-n", "1"),
                    "malformed worker address 'nonsense'")


def test_cli_port_nobody_listens_on():
    port = free_port()
    _one_error_line(run_cli_quick("info", "--rpc", f"127.0.0.1:{port}"), f"nothing listens on 127.0.0.1:{port}")


def test_cli_protocol_mismatch(fake):
    w = fake("ok", version=(3, 0, 0))
    _one_error_line(run_cli_quick("run", "--rpc", str(w.endpoint), "-ngl", "-1", "-p", "hi", "-n", "1"),
                    f"the worker {w.endpoint} speaks llama.cpp RPC protocol 3.0.0")


def test_cli_worker_refuses_a_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        _one_error_line(run_cli_quick("rpc-worker", "--port", str(port)), f"the port {port}", "in use")


def test_cli_worker_warns_about_any_address_but_loopback():
    # an address this machine does not have: the warning, then the refusal to listen
    done = run_cli_quick("rpc-worker", "--host", "10.255.255.1", "--port", str(free_port()))
    _one_error_line(done, "cannot listen on 10.255.255.1")
    assert "warning: listening on 10.255.255.1" in done.stderr
    assert "no authentication and no encryption" in done.stderr


def test_cli_worker_names_an_unknown_device():
    _one_error_line(run_cli_quick("rpc-worker", "--device", "GPU7", "--port", str(free_port())),
                    "no device named GPU7", "CPU")


def test_cli_info_says_the_rpc_backend_is_there():
    done = run_cli_quick("info")
    assert done.returncode == 0 and "RPC backend     yes" in done.stdout


# -- the weights cache's name as llama.cpp reads it ----------------------------------------------

def test_the_cache_folder_is_its_own_bytes_on_posix(tmp_path):
    folder = tmp_path / "Zoë Müller" / "缓存"
    assert rpc.cache_dir_argument(folder, windows=False) == (str(folder).encode("utf-8"), None)


def test_on_windows_the_cache_folder_is_named_as_the_ansi_api_reads_it():
    """MSVC's std::filesystem reads a char string in the ANSI code page, not UTF-8."""
    never = lambda name: pytest.fail("an ASCII name needs no short name")   # noqa: E731
    assert rpc.cache_dir_argument(r"C:\rpc cache", windows=True, short_path=never) == (b"C:\\rpc cache", None)
    profile = r"C:\Users\Zoë Müller\AppData\Local\cache"
    # the short name, ASCII, when the volume keeps them
    short = r"C:\Users\ZOMLLE~1\AppData\Local\cache"
    arg, note = rpc.cache_dir_argument(profile, windows=True, short_path=lambda name: short, ansi="cp1252")
    assert arg == b"C:\\Users\\ZOMLLE~1\\AppData\\Local\\cache" and "short name" in note
    # no short names (fsutil 8dot3name): the ANSI bytes, never UTF-8
    for no_short in (lambda name: None, lambda name: name):
        arg, note = rpc.cache_dir_argument(profile, windows=True, short_path=no_short, ansi="cp1252")
        assert arg == profile.encode("cp1252") != profile.encode("utf-8") and note is None
    # letters the code page lacks and no short name: refused, saying what to do
    with pytest.raises(RpcError, match=r"缓存.*ANSI code page.*--cache C:\\rpc-cache"):
        rpc.cache_dir_argument(r"C:\Users\Zoë\缓存", windows=True, short_path=lambda name: None, ansi="cp1252")
