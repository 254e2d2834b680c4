"""Remote workers (issue 12): this machine alone vs layers on 1 and 2 loopback workers.

    python -m benchmarks.rpc [--prompt 256] [--tokens 48] [--repeats 3] [--threads 1]

Starts three ``checkpoint-chat rpc-worker`` processes on 127.0.0.1 (each ends itself
after ten minutes whatever happens) and loads SmolLM2 three times: here, with every
layer (``-ngl -1``) on one worker, and split over the two others.  Each repeat, in
rotating order: prefill the prompt, generate greedily, save a full checkpoint, restore
it into an emptied cache.  Reported: tokens/s of
prefill and generation, save and restore time (best of the repeats), the checkpoint's
state size, the bytes sent to and received from the workers per generated token (the
client's sockets, Linux TCP_INFO), and whether the text and the saved state equal the
local run's.

Loopback has no network cost worth the name: what the numbers show is the protocol's
own overhead (serialising graphs, the hop through the client between two workers).
On these 2-core machines client and workers share the cores.  Exits 0 whatever the
numbers.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    Table,
    clock,
    context_settings,
    ctx_size_for,
    greedy_conversation,
    model_path,
    prompt_tokens,
)

ROOT = Path(__file__).resolve().parent.parent
_WORKER = ("import signal, sys; signal.alarm(600); from engine.cli import main; "
           "sys.exit(main(sys.argv[1:]))")


def table() -> Table:
    return Table("Layers on llama.cpp RPC workers over loopback vs this machine alone (SmolLM2, best of N)",
                 ["topology", "layers", "load_s", "prefill_tok_s", "gen_tok_s", "save_s", "restore_s",
                  "state_MB", "sent_B_per_tok", "recv_B_per_tok", "same_text", "same_state"])


def start_workers(n: int, threads: int) -> list:
    import socket

    from native.endpoint import Endpoint
    from native.rpc import wait_until_serving
    procs = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-c", _WORKER, "rpc-worker", "--port", str(port),
                                 "--threads", str(threads)], cwd=str(ROOT),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append((proc, Endpoint("127.0.0.1", port)))
        if not wait_until_serving(procs[-1][1], 60):
            raise SystemExit(f"the worker on port {port} did not start")
    return procs


class Topology:
    """One model loaded with its layers here or on workers, and its best figures."""

    def __init__(self, name: str, endpoints, args) -> None:
        from engine.runtime import Runtime
        from native.rpc import Workers
        self.name, self.endpoints, self.args = name, list(endpoints), args
        workers = Workers.connect([str(e) for e in endpoints]) if endpoints else None
        settings = context_settings(ctx_size_for(args.prompt + args.tokens), args.threads)
        started = clock()
        self.rt = Runtime(model_path("smollm"), settings, n_gpu_layers=-1 if workers else 0, workers=workers)
        self.best: dict = {"load_s": clock() - started,
                           "layers": self.rt.model.placement or f"{self.rt.model.shape.n_layer + 1} here"}
        self.tokens = prompt_tokens(self.rt.model, args.prompt)

    def trial(self, folder: Path) -> None:
        from engine.checkpoints.format import read_checkpoint
        from engine.generation import generate
        from native.rpc_guard import worker_traffic
        rt, best = self.rt, self.best
        rt.trim(0)
        conv = greedy_conversation(self.tokens, n_predict=self.args.tokens)
        report = rt.prefill(conv.tokens)
        before = worker_traffic(self.endpoints) if self.endpoints else None
        result = generate(rt, conv)
        after = worker_traffic(self.endpoints) if self.endpoints else None
        path = folder / f"{self.name.replace(' ', '-')}.kvckpt"
        started = clock()
        rt.save(path, conv)
        save_s = clock() - started
        data = read_checkpoint(path)
        rt.trim(0)
        started = clock()
        rt.restore_chain([data])
        restore_s = clock() - started
        best["prefill_tok_s"] = max(best.get("prefill_tok_s", 0.0), report.n_decoded / report.seconds)
        best["gen_tok_s"] = max(best.get("gen_tok_s", 0.0), result.tokens_per_s)
        best["save_s"] = min(best.get("save_s", float("inf")), save_s)
        best["restore_s"] = min(best.get("restore_s", float("inf")), restore_s)
        best.update(state_MB=len(data.state) / 1e6, text=result.text, state=bytes(data.state))
        if before is not None and after is not None and result.n_generated:
            best["sent_B_per_tok"] = (after[0] - before[0]) / result.n_generated
            best["recv_B_per_tok"] = (after[1] - before[1]) / result.n_generated

    def close(self) -> None:
        self.rt.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    p.add_argument("--tokens", type=int, default=48, help="generated tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1,
                   help="threads of this process and of each worker (default 1: 2 cores, 4 processes)")
    args = p.parse_args(argv)

    from native.library import bindings
    bindings()
    t = table()
    # three workers: one for the single-worker model, two for the other, so that all
    # three models stay loaded and the trials interleave (a worker serves one client)
    procs = start_workers(3, args.threads)
    endpoints = [e for _p, e in procs]
    topologies = []
    try:
        topologies.append(Topology("this machine", [], args))
        topologies.append(Topology("1 worker", endpoints[:1], args))
        topologies.append(Topology("2 workers", endpoints[1:], args))
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.repeats):
                for top in topologies[r % 3:] + topologies[:r % 3]:   # rotating order
                    top.trial(Path(tmp))
    finally:
        for top in topologies:
            top.close()
        for proc, _e in procs:
            proc.kill()
            proc.wait(10)
    local = topologies[0].best
    for top in topologies:
        row = dict(top.best)
        if top is not topologies[0]:
            row["same_text"] = row["text"] == local["text"]
            row["same_state"] = row["state"] == local["state"]
        t.add(topology=top.name, **{k: v for k, v in row.items() if k in t.columns})
    t.notes.append(f"prompt {args.prompt} tokens, {args.tokens} generated, {args.threads} threads per process, "
                   "loopback: client and workers share this machine's cores")
    t.notes.append("sent/recv: bytes on the client's sockets to the workers while generating, per token")
    print(t.render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
