"""``checkpoint-chat rpc-worker``, and the command line's side of remote workers.

A worker serves one device of this machine (the CPU or a GPU) to the clients that name
it with ``--rpc HOST:PORT``: llama.cpp's own RPC server, run in this process
(native.rpc.serve).  It listens on 127.0.0.1 unless ``--host`` says otherwise, and
warns whenever the address is not loopback: the protocol has no authentication and no
encryption.  It serves one client at a time, until Ctrl+C.

:func:`connect_workers` is what ``run --rpc`` and ``info --rpc`` call: the workers
checked (bounded waits), registered with llama.cpp, and a lost worker reported in one
sentence (native.rpc.install_abort_handler), also as the first line of this run's crash
trace so that the next start names it.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from engine import crashlog
from engine.cli.output import EXIT_ERROR, EXIT_OK, human_size

NOT_LOOPBACK_WARNING = (
    "warning: listening on {endpoint}, which is not this machine's loopback address. "
    "llama.cpp's RPC has no authentication and no encryption: anyone who can reach this port "
    "can use this machine's {devices} and its memory, read what clients send (model weights, "
    "the conversation's KV cache) and send the worker malformed requests. Use it only on a "
    "network you trust, and let your firewall admit only the clients' addresses.")


def connect_workers(spec: str, timeout: float | None):
    """The workers named on the command line, checked and registered (native.rpc.Workers)."""
    from native.rpc import IO_TIMEOUT_S, Workers
    return Workers.connect(spec, io_timeout=timeout or IO_TIMEOUT_S, crash_note=crashlog.trace_path())


def cmd_rpc_worker(args) -> int:
    from native.context import _physical_cores as physical_cores  # the app's one rule
    from native.endpoint import Endpoint
    from native.library import bindings, choose_library
    from native.rpc import (
        PROTOCOL,
        RpcError,
        cache_dir_argument,
        device_memory,
        pick_devices,
        port_problem,
        serve,
    )

    bindings(choose_library(cli_dir=args.llama_lib))
    endpoint = Endpoint(args.host.strip(), args.port)
    if not endpoint.host or any(c.isspace() or c == ":" for c in endpoint.host):
        raise RpcError(f"--host takes a host name or an IPv4 address, not '{args.host}'")
    devices = pick_devices(args.device)
    if not endpoint.is_loopback:   # said before anything else, also when listening then fails
        print(NOT_LOOPBACK_WARNING.format(endpoint=endpoint,
                                          devices=", ".join(d.name for d in devices)), file=sys.stderr)
    problem = port_problem(endpoint)
    if problem:
        raise RpcError(problem)
    cache = Path(args.cache).expanduser().resolve() if args.cache else None
    cache_note = None
    if cache is not None:
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RpcError(f"cannot use {cache} as the weights cache: {exc.strerror or exc}") from None
        cache_note = cache_dir_argument(cache)[1]      # refuses a name llama.cpp cannot open
    threads = args.threads or physical_cores()
    print(f"Checkpoint Chat RPC worker: llama.cpp RPC protocol {'.'.join(map(str, PROTOCOL))}, "
          f"listening on {endpoint}")
    for d in devices:
        free, total = device_memory(d)
        print(f"  device {d.name}: {d.description}, {human_size(free)} free of {human_size(total)}")
    print(f"  threads {threads}; weights cache: {cache or 'none'}"
          + (f" ({cache_note})" if cache_note else ""))
    print(f"Clients use it with: checkpoint-chat run --rpc {endpoint} -ngl -1")
    print("It serves one client at a time. Ctrl+C stops it.", flush=True)

    # llama.cpp's loop never returns while it serves, and a signal only reaches Python
    # between bytecodes: it runs on a thread of its own, so Ctrl+C still works here
    done = threading.Event()

    def run() -> None:
        try:
            serve(endpoint, devices, threads=threads, cache_dir=cache)
        finally:
            done.set()

    threading.Thread(target=run, name="rpc-server", daemon=True).start()
    try:
        while not done.wait(0.5):
            pass
    except KeyboardInterrupt:     # the usual way to stop a worker
        print("worker stopped", file=sys.stderr)
        return EXIT_OK
    print(f"error: llama.cpp could not serve on {endpoint} (see its message above)", file=sys.stderr)
    return EXIT_ERROR


def print_remote_devices(workers, as_json: bool = False) -> list[dict]:
    """``info --rpc``: each remote device with its free and total memory."""
    rows = [{"name": dev.name, "endpoint": str(dev.endpoint), "memory_free": free,
             "memory_total": total} for dev, free, total in workers.memory()]
    if not as_json:
        for row in rows:
            print(f"remote device   {row['name']} at {row['endpoint']}: "
                  f"{human_size(row['memory_free'])} free of {human_size(row['memory_total'])}")
    return rows
