"""Section e: pause latency, mid-prefill and mid-generation, and until the checkpoint is
durable on disk.

The engine runs ``generate`` on its own thread, as the app does; the main thread calls
``Control.request_pause()`` at staggered moments.  Measured from that call: when the
last token reached the listener (generation only), when ``generate`` returned, and when
the pause checkpoint (``Runtime.save``: atomic write, fsync, folder fsync) was complete.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from benchmarks.common import Table, clock, greedy_conversation, median, prompt_tokens

MB = 1e6


def table() -> Table:
    return Table("e. Pause latency (ms from Control.request_pause on another thread)",
                 ["model", "phase", "context", "trials", "halt_ms", "halt_max_ms", "last_token_ms",
                  "durable_ms", "durable_max_ms", "ckpt_MB"])


class _Recorder:
    def __init__(self, notify_after: int) -> None:
        self.times: list[float] = []
        self.notify_after = notify_after
        self.ready = threading.Event()

    def on_prefill_progress(self, done: int, total: int) -> None:
        pass

    def on_text(self, delta: str) -> None:
        self.times.append(clock())
        if len(self.times) >= self.notify_after:
            self.ready.set()


def _trial(rt, conv, path: Path, *, wait, notify_after: int = 1 << 30) -> dict:
    from engine.checkpoints.format import KIND_PAUSE
    from engine.generation import Control, generate
    control = Control()
    rec = _Recorder(notify_after)
    box: dict = {}

    def engine_thread() -> None:
        try:
            box["result"] = generate(rt, conv, control=control, listener=rec)
            box["returned"] = clock()
            box["size"] = rt.save(path, conv, KIND_PAUSE).size
            box["saved"] = clock()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            box["error"] = exc

    th = threading.Thread(target=engine_thread, name="engine")
    th.start()
    wait(rec)
    requested = clock()
    control.request_pause()
    th.join()
    if "error" in box:
        raise box["error"]
    after = [t for t in rec.times if t >= requested]
    return {"paused": box["result"].paused, "prefill_aborted": box["result"].n_generated == 0
            and box["result"].n_prefilled < box["result"].n_prompt_tokens,
            "halt": box["returned"] - requested, "durable": box["saved"] - requested,
            "last_token": (after[-1] - requested) if after else 0.0, "size": box["size"]}


def measure(rt, key: str, prefill_context: int, trials: int, folder: Path, out: Table, *,
            delay: tuple[float, float] = (0.4, 1.2)) -> None:
    path = folder / f"{key}-pause.kvckpt"
    # mid-prefill: a long prompt, the request lands delay[0] .. delay[0] + delay[1] s into it
    tokens = prompt_tokens(rt.model, prefill_context)
    got = []
    for i in range(trials):
        rt.trim(0)
        rt.ctx.clear()
        wait_s = delay[0] + delay[1] * i / max(1, trials - 1)
        r = _trial(rt, greedy_conversation(tokens), path, wait=lambda _rec, d=wait_s: time.sleep(d))
        if r["prefill_aborted"]:
            got.append(r)
    if got:
        out.add(model=key, phase="prefill", context=prefill_context, trials=len(got),
                halt_ms=1000 * median([g["halt"] for g in got]), halt_max_ms=1000 * max(g["halt"] for g in got),
                last_token_ms=None, durable_ms=1000 * median([g["durable"] for g in got]),
                durable_max_ms=1000 * max(g["durable"] for g in got), ckpt_MB=median([g["size"] for g in got]) / MB)
    if len(got) < trials:
        out.notes.append(f"{key}: {trials - len(got)} prefill trials finished before the pause request")

    # mid-generation: a short prompt, the request lands after 8 + i tokens, between tokens
    short = tokens[:min(len(tokens), 128)]
    got = []
    for i in range(trials):   # the short prompt stays cached from one trial to the next
        offset = (i % 4) * 0.004  # stagger the request within a token's decode

        def wait(rec, o=offset):
            rec.ready.wait()
            time.sleep(o)
        got.append(_trial(rt, greedy_conversation(short), path, wait=wait, notify_after=8 + i))
    out.add(model=key, phase="generate", context=len(short), trials=len(got),
            halt_ms=1000 * median([g["halt"] for g in got]), halt_max_ms=1000 * max(g["halt"] for g in got),
            last_token_ms=1000 * median([g["last_token"] for g in got]),
            durable_ms=1000 * median([g["durable"] for g in got]),
            durable_max_ms=1000 * max(g["durable"] for g in got), ckpt_MB=median([g["size"] for g in got]) / MB)
    path.unlink(missing_ok=True)
