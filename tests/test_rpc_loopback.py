"""Remote workers for real: `checkpoint-chat rpc-worker` processes on 127.0.0.1.

Every worker is started by the test (each ends itself by SIGALRM after WORKER_LIFE_S,
whatever happens to the test) and every client is a process of its own: llama.cpp ends
the process that loses a worker, and that must never be pytest.

- Layers on one and on two workers give the text a local run gives (greedy and 0.8).
- Checkpoints cross topologies: paused with remote layers, resumed on this machine alone,
  and the reverse, byte-identical to an uninterrupted run; the KV state saved from remote
  cells is the bytes saved from local ones.  Delta autosaves and prefix reuse with remote
  layers.
- A worker killed or stopped while loading, in prefill, while generating and during a
  save: one sentence naming it, exit status 1, no traceback, bounded waits; the last
  checkpoint restores (here, without workers) and the next start names the worker.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, run_cli

WORKER_LIFE_S = 240
PROMPT = "Write a few lines about lighthouses."
N, K = 24, 8
COMMON = ["-p", PROMPT, "--seed", "7", "-n", str(N), "--ctx-size", "512", "--ignore-eos"]

_WORKER_MAIN = (f"import signal, sys; signal.alarm({WORKER_LIFE_S}); from engine.cli import main; "
                "sys.exit(main(sys.argv[1:]))")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """One `checkpoint-chat rpc-worker` on a free loopback port."""

    def __init__(self, log_dir: Path) -> None:
        from native.endpoint import Endpoint
        from native.rpc import wait_until_serving
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log = log_dir / f"worker-{self.port}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_MAIN, "rpc-worker", "--port", str(self.port), "--threads", "1"],
            stdout=open(self.log, "w"), stderr=subprocess.STDOUT, cwd=str(ROOT))
        if not wait_until_serving(Endpoint("127.0.0.1", self.port), 60):
            self.close()
            raise AssertionError(f"the worker did not start:\n{self.log.read_text()}")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        """SIGSTOP, and wait until every thread has stopped: kill() returns before a busy
        thread on the other core has (seen once in CI on a loaded machine: the worker
        still answered the save that followed)."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        tasks = Path(f"/proc/{self.proc.pid}/task")
        while time.monotonic() < deadline:
            try:
                states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()]
            except OSError:     # a thread came or went while we looked
                continue
            if all(state in ("T", "t") for state in states):
                return
            time.sleep(0.005)
        raise AssertionError("the worker did not stop within 10 s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Two workers shared by the tests that keep them alive."""
    made = [Worker(tmp_path_factory.mktemp("workers")) for _ in range(2)]
    yield made
    for w in made:
        w.close()


@pytest.fixture
def doomed(tmp_path):
    """A worker of this test's own, to kill or stop."""
    w = Worker(tmp_path)
    yield w
    w.close()


def run(*args: str, env: dict | None = None) -> dict:
    done = run_cli("run", *args, "--json", timeout=180, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def rpc_args(*ws: Worker, ngl: str = "-1") -> list[str]:
    return ["--rpc", ",".join(w.endpoint for w in ws), "-ngl", ngl]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The local, uninterrupted answers everything is compared with: {temp: text}."""
    env = {"CHECKPOINT_CHAT_HOME": str(tmp_path_factory.mktemp("home"))}
    return {temp: run(*COMMON, "--temp", temp, "--threads", "2", env=env)["text"] for temp in ("0", "0.8")}


# -- same text, wherever the layers are ------------------------------------------------------------

def test_one_and_two_workers_give_the_local_text(workers, uninterrupted):
    a, b = workers
    for temp, text in uninterrupted.items():
        assert text.strip()
        assert run(*COMMON, "--temp", temp, *rpc_args(a))["text"] == text, f"1 worker, temp {temp}"
        assert run(*COMMON, "--temp", temp, *rpc_args(a, b))["text"] == text, f"2 workers, temp {temp}"


def test_placement_is_what_llama_cpp_did(workers, uninterrupted):
    """The model bar's "layers: ..." (native.rpc.layer_plan) against llama.cpp's own log."""
    a, b = workers
    done = run_cli("-v", "run", *COMMON, "--temp", "0", *rpc_args(a, b, ngl="20"), timeout=180, check=True)
    assigned: dict[str, int] = {}
    for device in re.findall(r"layer +\d+ assigned to device (\S+),", done.stderr):
        assigned[device] = assigned.get(device, 0) + 1
    names = sorted(d for d in assigned if d.startswith("RPC"))
    assert len(names) == 2 and assigned["CPU"] == 11, assigned
    placement = re.search(r"\[RPC\] (layers: .*)", done.stderr).group(1)
    assert placement == (f"layers: {assigned[names[0]]} on {a.endpoint}, {assigned[names[1]]} on "
                         f"{b.endpoint}, 11 on this machine")
    assert done.stdout.strip() == uninterrupted["0"].strip()


# -- checkpoints across topologies -----------------------------------------------------------------

def test_pause_remote_resume_local_and_the_reverse(workers, uninterrupted, tmp_path):
    from engine.checkpoints.format import read_checkpoint
    a, b = workers
    full = uninterrupted["0.8"]
    remote_ckpt, local_ckpt = tmp_path / "remote.kvckpt", tmp_path / "local.kvckpt"

    first = run(*COMMON, "--temp", "0.8", *rpc_args(a), "--stop-after", str(K),
                "--checkpoint-save", str(remote_ckpt))
    second = run("--checkpoint-load", str(remote_ckpt), "--threads", "2")       # no worker at all
    assert second["n_reused_tokens"] == second["n_prompt_tokens"], "the prompt was decoded again"
    assert first["text"] + second["text"] == full

    first = run(*COMMON, "--temp", "0.8", "--threads", "2", "--stop-after", str(K),
                "--checkpoint-save", str(local_ckpt))
    second = run("--checkpoint-load", str(local_ckpt), *rpc_args(a, b))        # layers on two workers
    assert first["text"] + second["text"] == full

    # the checkpoint's bytes do not depend on where the KV cells lived
    remote, local = read_checkpoint(remote_ckpt), read_checkpoint(local_ckpt)
    assert bytes(remote.state) == bytes(local.state)
    assert list(remote.tokens) == list(local.tokens)
    assert bytes(remote.logits) == bytes(local.logits)


def test_delta_autosaves_and_prefix_reuse_with_remote_layers(workers, uninterrupted, tmp_path):
    from engine.checkpoints.format import read_header
    a, b = workers
    # autosaves every 4 tokens with the layers remote: a chain of deltas in the store
    first = run(*COMMON, "--temp", "0.8", *rpc_args(a, b), "--stop-after", str(K + 4),
                "--checkpoint-save-interval", "4")
    head = Path(first["checkpoint"])
    assert read_header(head).is_delta
    second = run("--checkpoint-load", str(head), "--threads", "2")              # resumed locally
    assert first["text"] + second["text"] == uninterrupted["0.8"]

    # a long shared system prompt: the second question restores it from the store
    system = "You are a lighthouse keeper's assistant. " * 12
    ask = ["--system", system, "--temp", "0", "-n", "8", "--ctx-size", "512", "--seed", "1"]
    run(*ask, "-p", "How tall is the tower?", *rpc_args(a))
    reused = run(*ask, "-p", "When was it built?", *rpc_args(a), "--reuse-prefix")
    fresh = run(*ask, "-p", "When was it built?", "--threads", "2")
    assert reused["prefix_reuse"] in ("restored", "restored-exact", "cache")
    assert reused["n_reused_tokens"] > 100
    assert reused["text"] == fresh["text"]


# -- faults -------------------------------------------------------------------------------------------

# The client as a script with gates: it says "PHASE <name>" and waits for a line on
# stdin, so the test kills or stops the worker exactly between two steps.
_CLIENT = r"""
import json, sys
from engine import crashlog
crashlog.install()
from engine.checkpoints.format import KIND_PAUSE
from engine.cli.parser import build_parser
from engine.cli.rpc import connect_workers
from engine.cli.run import context_settings, sampler_from_args
from engine.conversation import Conversation
from engine.generation import begin_answer, commit_answer, generate
from engine.models import default_model_path
from engine.runtime import Runtime
from engine.sampling import defaults_for_model_file
from native.rpc_guard import SocketGuard

phase, rpc, timeout, ckpt, k, *cli = sys.argv[1:]
k = int(k)
args = build_parser().parse_args(["run", *cli])

def gate(name):
    if "rt" in globals():
        rt.ctx.synchronize()   # no answer in flight: the fault lands between two steps
    print("PHASE " + name, flush=True)
    sys.stdin.readline()
    # the short timeout only from here on: a loaded machine may stall a healthy worker
    # for a second or two before the fault
    SocketGuard(workers.endpoints, float(timeout)).apply()

workers = connect_workers(rpc, float(timeout) if phase == "load" else 60)
if phase == "load":
    gate(phase)
path = default_model_path()
rt = Runtime(path, context_settings(args, None), n_gpu_layers=-1, workers=workers)
defaults, _ = defaults_for_model_file(path)
conv = Conversation(sampler=sampler_from_args(args, defaults))
begin_answer(conv, rt, args.prompt, n_predict=args.n_predict)
if phase == "prefill":
    gate(phase)
first = generate(rt, conv, stop_after=k)
commit_answer(conv)
rt.save(ckpt, conv, KIND_PAUSE)
print("SAVED " + json.dumps(first.text), flush=True)
if phase == "generation":
    gate(phase)
    generate(rt, conv, stop_after=k)
if phase == "save":
    generate(rt, conv, stop_after=k)
    commit_answer(conv)
    gate(phase)
    rt.save(ckpt, conv, KIND_PAUSE)
print("SURVIVED", flush=True)
"""


def _client(phase: str, worker: Worker, ckpt: Path, timeout: float, others=()) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _CLIENT, phase, ",".join(w.endpoint for w in (*others, worker)), str(timeout),
         str(ckpt), str(K),
         *COMMON, "--temp", "0.8"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT),
        env=dict(os.environ))


def _fault(phase: str, how: str, worker: Worker, tmp_path: Path, io_timeout: float = 2.0, others=()):
    """Run the client to ``phase``, kill or stop the worker, let it go on; what it said."""
    ckpt = tmp_path / "last.kvckpt"
    client = _client(phase, worker, ckpt, io_timeout, others)
    saved = None
    try:
        for line in client.stdout:
            if line.startswith("SAVED "):
                saved = json.loads(line[6:])
            if line.startswith("PHASE "):
                break
        else:
            raise AssertionError(f"the client never reached {phase}: {client.stderr.read()}")
        worker.kill() if how == "kill" else worker.stop()
        went_on = time.monotonic()
        try:
            client.stdin.write("go\n")
            client.stdin.flush()
        except BrokenPipeError:     # it did not wait for the go: its stderr says why
            pass
        out, err = client.communicate(timeout=60)
        waited = time.monotonic() - went_on
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    return client.returncode, out, err, waited, saved, ckpt


def _assert_one_sentence(rc: int, out: str, err: str, worker: Worker) -> str:
    assert "SURVIVED" not in out
    assert rc == 1, (rc, err)
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    assert errors[0].startswith(f"error: the remote worker {worker.endpoint} "), errors[0]
    assert "checkpoints are kept" in errors[0]
    return errors[0]


def _assert_next_start_names(worker: Worker, app_home: Path) -> None:
    from engine import crashlog
    reports = crashlog.pending_crashes(app_home / "log")
    assert reports and reports[-1].excerpt.startswith(f"Fatal: the remote worker {worker.endpoint}")


@pytest.mark.parametrize("phase, how, expect", [
    ("load", "kill", "could not be reached"),
    ("load", "stop", "stopped answering (no reply within 2 s"),
    ("prefill", "kill", "closed the connection"),
    ("prefill", "stop", "stopped answering"),
    ("generation", "kill", "closed the connection"),
    ("save", "kill", "closed the connection"),
    ("generation", "stop", "stopped answering"),
    ("save", "stop", "stopped answering"),
])
def test_a_lost_worker_is_one_sentence_and_the_last_checkpoint_restores(
        phase, how, expect, doomed, tmp_path, app_home, uninterrupted):
    rc, out, err, waited, saved, ckpt = _fault(phase, how, doomed, tmp_path)
    sentence = _assert_one_sentence(rc, out, err, doomed)
    assert expect in sentence
    assert waited < (2 + 10 if how == "stop" else 10), waited
    _assert_next_start_names(doomed, app_home)
    if saved is None:
        assert not ckpt.exists()
        return
    # the checkpoint written before the fault is whole (a failed save never touches it,
    # and leaves no temp file), and it continues on this machine alone, byte-identically
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("last")] == ["last.kvckpt"]
    assert run_cli("validate", str(ckpt), timeout=60).returncode == 0
    second = run("--checkpoint-load", str(ckpt), "--threads", "2")
    assert saved + second["text"] == uninterrupted["0.8"]


def test_losing_one_of_two_workers_names_that_one(doomed, tmp_path, app_home):
    other = Worker(tmp_path)
    try:
        rc, out, err, waited, saved, ckpt = _fault("generation", "kill", doomed, tmp_path, others=[other])
    finally:
        other.close()
    assert "closed the connection" in _assert_one_sentence(rc, out, err, doomed)
    assert other.endpoint not in err
    assert saved is not None and run_cli("validate", str(ckpt), timeout=60).returncode == 0


def test_a_worker_hung_before_the_model_loads_is_bounded(doomed):
    doomed.stop()
    started = time.monotonic()
    done = run_cli("run", *COMMON, *rpc_args(doomed), timeout=60)
    assert time.monotonic() - started < 30
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 1 and "Traceback" not in done.stderr and len(errors) == 1
    assert errors[0] == (f"error: the worker {doomed.endpoint} accepted the connection but did not "
                         "answer within 5 s (it is serving another client, or it hangs)")


def test_the_cli_loses_a_worker_mid_answer_and_resumes_its_autosave_locally(doomed, app_home):
    client = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "run", *COMMON[:4], "-n", "4000", "--ignore-eos", "--temp", "0.8",
         "--ctx-size", "4096", *rpc_args(doomed), "--checkpoint-save-interval", "8", "--progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(ROOT), env=dict(os.environ))
    try:
        for line in client.stderr:
            if line.startswith("[STAGE] generating"):
                break
        from engine.checkpoints.store import Store
        deadline = time.monotonic() + 60                  # an autosave (every 8 tokens) first
        while not list(Store().folder.glob("autosave-*.kvckpt")) and time.monotonic() < deadline:
            time.sleep(0.1)
        doomed.kill()
        out, rest = client.communicate(timeout=60)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    assert client.returncode == 1 and "Traceback" not in rest
    errors = [line for line in rest.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: the remote worker {doomed.endpoint} "), rest
    # the next start says what happened and offers the newest autosave, which resumes
    # on this machine alone
    done = run_cli("run", "-p", "hi", "-n", "1", "--threads", "2", timeout=120, check=True)
    assert f"crashed in an earlier run (Fatal: the remote worker {doomed.endpoint}" in done.stderr
    autosave = re.search(r"resumed with: checkpoint-chat run --checkpoint-load (\S+)", done.stderr).group(1)
    resumed = run("--checkpoint-load", autosave, "--stop-after", "8", "--threads", "2")
    # an autosave: its last token, a generated one, is decoded again (engine.runtime.logits_rule)
    assert resumed["n_generated"] == 8 and resumed["n_reused_tokens"] == resumed["n_prompt_tokens"] - 1


def test_a_worker_outlives_a_killed_client(doomed, tmp_path):
    client = _client("generation", doomed, tmp_path / "c.kvckpt", 5)
    for line in client.stdout:
        if line.startswith("PHASE "):
            break
    client.kill()
    client.wait()
    done = run_cli("info", "--rpc", doomed.endpoint, timeout=60, check=True)
    assert f"at {doomed.endpoint}" in done.stdout
