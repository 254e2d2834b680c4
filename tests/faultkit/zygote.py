"""A pre-imported process that forks workers on request (POSIX only).

Starting Python and importing numpy and the engine costs a few hundred milliseconds;
a fork of a process that has already done so costs about one.  Tests that SIGKILL
hundreds of writers ask this zygote for each one: it stays single-threaded and never
loads llama.cpp itself, so forking it is safe (a worker that needs a model loads it
after the fork).

Protocol, one line each way: ``spawn <json spec>`` -> ``pid <n>``;
``reap <pid>`` -> ``status <waitpid status>``.  Workers report through files named in
their spec (see faultkit.workers), never through the zygote's pipes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent.parent
ROOT = TESTS_DIR.parent


def _serve() -> None:
    from faultkit import workers  # noqa: F401  (imported once, inherited by every fork)
    out = sys.stdout
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "spawn":
            spec = json.loads(arg)
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    signal.signal(signal.SIGINT, signal.SIG_DFL)
                    workers.run(spec)
                except BaseException:
                    code = 1
                    with open(spec["error_log"], "a", encoding="utf-8") as f:
                        f.write(traceback.format_exc())
                finally:
                    os._exit(code)
            out.write(f"pid {pid}\n")
        elif cmd == "reap":
            _, status = os.waitpid(int(arg), 0)
            out.write(f"status {status}\n")
        elif cmd == "quit":
            return
        out.flush()


class Zygote:
    """The test side: start one zygote, spawn and kill workers through it."""

    def __init__(self, env: dict | None = None) -> None:
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(TESTS_DIR), str(ROOT), full_env.get("PYTHONPATH", "")])
        full_env["OPENBLAS_NUM_THREADS"] = "1"   # no BLAS threads to be caught by fork
        self.proc = subprocess.Popen([sys.executable, "-m", "faultkit.zygote"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=full_env, cwd=str(ROOT))

    def _ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"the zygote died (exit status {self.proc.wait()})")
        return reply.split(" ", 1)[1].strip()

    def spawn(self, spec: dict) -> int:
        return int(self._ask("spawn " + json.dumps(spec)))

    def reap(self, pid: int) -> int:
        """Wait for ``pid``; returns its waitpid status."""
        return int(self._ask(f"reap {pid}"))

    def kill(self, pid: int) -> bool:
        """SIGKILL ``pid`` and reap it; True if the kill (not its own exit) ended it."""
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        status = self.reap(pid)
        return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    _serve()
