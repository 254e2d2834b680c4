"""How long does the UI thread ever stop answering?  (A benchmark, not a test.)

Runs the real main window offscreen with the real default model and a 5 ms heartbeat
timer on the UI thread.  For each phase it reports the longest gap between heartbeats
minus the 5 ms period: the longest stall the user could have felt.  Target (issue 13):
no stall above 16 ms (one frame) in any phase, generation speed within 3%.

Phases: model load; prefill of ~4,000 prompt tokens; generation; saving the resulting
large checkpoint; full validation (CRC) of a synthesized 1 GB checkpoint file through
the browser; the time from clicking Pause to the last token arriving, during
generation and during prefill; and two answers streaming at once in two conversations,
one of them paused while the other goes on (issue 11: under 16 ms too).

    QT_QPA_PLATFORM=offscreen python benchmarks/ui_stall.py [--threads N] [--keep]
        [--compute-priority normal|low] [--nice N] [--batch N] [--phases ...] [--diagnose]
    QT_QPA_PLATFORM=offscreen python benchmarks/ui_stall.py --compare normal,low [--rounds 3]

``--compare`` runs the window once per configuration in alternating rounds, each in a
fresh process started when the machine's load is low, and prints one table.
``--diagnose`` names what every thread was doing at each late heartbeat.
"""

from __future__ import annotations

import argparse
import os
import shutil
import struct
import sys
import tempfile
import time
import uuid
import zlib
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PERIOD_MS = 5
PARAGRAPH = ("The archive of the northern city held maps, letters and ledgers from three "
             "centuries of trade; each shelf was labelled by hand and every visitor signed "
             "the register before touching a single page. ")


class Heartbeat:
    """A 5 ms timer on the UI thread; records when each tick really ran."""

    def __init__(self) -> None:
        from PySide6.QtCore import Qt, QTimer
        self.ticks: list[float] = []
        self.timer = QTimer()
        self.timer.setTimerType(Qt.TimerType.PreciseTimer)
        self.timer.setInterval(PERIOD_MS)
        self.timer.timeout.connect(lambda: self.ticks.append(time.perf_counter()))
        self.timer.start()

    def mark(self) -> int:
        return len(self.ticks)

    def stall_ms(self, start: int, end: int | None = None) -> tuple[float, float, int]:
        """Longest gap minus the period, the 99th percentile gap, and the tick count."""
        ticks = self.ticks[max(0, start - 1):end]
        timed = [((b - a) * 1000, a) for a, b in pairwise(ticks)]
        if timed and os.environ.get("UI_STALL_DEBUG"):
            gap, at = max(timed)
            print(f"  longest gap {gap:.1f} ms began {(at - ticks[0]) * 1000:.0f} ms into the phase")
        gaps = sorted(g for g, _ in timed)
        if not gaps:
            return float("nan"), float("nan"), 0
        p99 = gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))]
        return max(0.0, gaps[-1] - PERIOD_MS), p99, len(gaps)


def wait_until(app, predicate, timeout: float) -> None:
    from PySide6.QtCore import QEventLoop
    deadline = time.perf_counter() + timeout
    while not predicate():
        if time.perf_counter() > deadline:
            raise TimeoutError("benchmark step timed out")
        app.processEvents(QEventLoop.ProcessEventsFlag.WaitForMoreEvents)  # wakes at least every heartbeat


def synthesize_big_checkpoint(path: Path, size: int = 1 << 30) -> Path:
    """A structurally valid checkpoint with a ~1 GB state (random bytes, correct CRC)."""
    import numpy as np

    from engine.checkpoints.format import TRAILER_MAGIC, Header, encode_metadata, pack_header
    n_tokens = 4096
    tokens = np.arange(n_tokens, dtype="<i4").tobytes()
    meta = encode_metadata({"title": "synthetic 1 GB", "conversation": {}})
    h = Header(model_fingerprint=b"\x42" * 16, model_size=1, n_vocab=32000, n_layer=32, n_head_kv=8,
               n_embd_head_k=128, n_embd_head_v=128, n_swa=0, n_ctx=8192, type_k=1, type_v=1,
               flash_attn=False, kv_unified=True, n_seq_max=1, n_tokens=n_tokens,
               n_tokens_total=n_tokens, n_generated=0, created_unix_ns=time.time_ns(),
               conversation_id=uuid.uuid4(), library="synthetic", title="synthetic 1 GB")
    h = replace(h, meta_len=len(meta), tokens_len=len(tokens), logits_len=0, state_len=size)
    chunk = os.urandom(8 << 20)
    with open(path, "wb") as f:
        f.write(pack_header(h))
        crc = 0
        for part in (meta, tokens):
            f.write(part)
            crc = zlib.crc32(part, crc)
        left = size
        while left:
            piece = chunk[:min(left, len(chunk))]
            f.write(piece)
            crc = zlib.crc32(piece, crc)
            left -= len(piece)
        f.write(struct.pack("<I", crc) + TRAILER_MAGIC)
    return path


class Watchdog:
    """``--diagnose``: what each thread was doing when the heartbeat ran late.

    A thread polls every 2 ms; when the last tick is more than ``late_ms`` old it takes
    the stacks of all threads once per gap (it needs the GIL for that, so a gap caused by
    a thread holding the GIL shows that thread's stack).  Garbage collections longer
    than 2 ms are recorded too.
    """

    def __init__(self, beat: Heartbeat, late_ms: float = 15.0) -> None:
        import gc
        import threading
        self.beat, self.late_s = beat, late_ms / 1000
        self.samples: list[tuple[float, float, dict[str, str]]] = []
        self.gcs: list[tuple[float, float, int]] = []
        self._gc_started = 0.0
        self._stop = threading.Event()
        gc.callbacks.append(self._on_gc)
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        self._thread.start()

    def _on_gc(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._gc_started = now
        elif now - self._gc_started > 0.002:
            self.gcs.append((self._gc_started, now - self._gc_started, info.get("generation", -1)))

    def _run(self) -> None:
        import sys as _sys
        import threading
        import traceback
        seen = None
        while not self._stop.wait(0.002):
            ticks = self.beat.ticks
            if not ticks:
                continue
            last = ticks[-1]
            late = time.perf_counter() - last
            if late > self.late_s and seen != last:
                seen = last
                names = {t.ident: t.name for t in threading.enumerate()}
                stacks = {}
                for ident, frame in _sys._current_frames().items():
                    name = names.get(ident, str(ident))
                    if name == "watchdog":
                        continue
                    lines = traceback.format_stack(frame, limit=4)
                    stacks[name] = " <- ".join(line.strip().splitlines()[0].split(", in ")[-1]
                                              + ":" + line.strip().split(", line ")[1].split(",")[0]
                                              for line in reversed(lines))
                self.samples.append((last, late, stacks))

    def stop(self) -> None:
        import gc
        self._stop.set()
        self._thread.join()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def report(self, phases: list[tuple[str, float, float]], top: int = 12) -> str:
        def phase_of(t: float) -> str:
            return next((name for name, a, b in phases if a <= t <= b), "-")
        out = ["", f"late heartbeats (>{self.late_s * 1000:.0f} ms), longest first:"]
        for last, late, stacks in sorted(self.samples, key=lambda x: -x[1])[:top]:
            out.append(f"  {late * 1000:6.1f} ms+ in {phase_of(last)}")
            for name, stack in stacks.items():
                out.append(f"      {name}: {stack}")
        long_gcs = sorted(self.gcs, key=lambda g: -g[1])[:top]
        out.append("garbage collections over 2 ms: " + (", ".join(
            f"{d * 1000:.1f} ms (gen {g}, {phase_of(t)})" for t, d, g in long_gcs) or "none"))
        return "\n".join(out)


def apply_levers(args) -> str:
    """Scheduling levers, applied to every context the window makes; returns a label."""
    import dataclasses

    import native.context as nc
    extra = {}
    if args.compute_priority:
        extra["compute_priority"] = args.compute_priority
    if args.batch:
        extra["n_batch"] = extra["n_ubatch"] = args.batch
    if extra:
        # a subclass with other defaults, not a partial: modules read the class's own
        # defaults at import (engine.parallel's FILE_SEQ_MAX)
        base = nc.ContextSettings
        nc.ContextSettings = dataclasses.make_dataclass(
            "ContextSettings", [(k, type(v), dataclasses.field(default=v)) for k, v in extra.items()],
            bases=(base,), frozen=base.__dataclass_params__.frozen)
    if args.nice is not None:
        nc.ComputeThreads.LINUX_NICE = args.nice
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval / 1000)
    parts = [f"priority {args.compute_priority or 'default'}"]
    if args.switch_interval:
        parts.append(f"GIL switch {args.switch_interval:g} ms")
    if args.nice is not None:
        parts.append(f"nice {args.nice}")
    if args.batch:
        parts.append(f"batch {args.batch}")
    return ", ".join(parts)


class WindowRun:
    """One window under the heartbeat, and the phases measured on it (one method each)."""

    def __init__(self, args) -> None:
        from PySide6.QtWidgets import QApplication

        from gui.main_window import MainWindow
        from gui.settings import AppSettings
        from gui.tasks import ensure_event_loop

        self.args = args
        self.app = QApplication.instance() or QApplication([])
        ensure_event_loop(self.app)
        s = AppSettings()
        s.n_ctx, s.n_threads, s.seed, s.n_predict, s.autosave_every = 8192, args.threads, 7, args.n_predict, 0
        self.w = w = MainWindow(s)
        w.show()
        self.beat = Heartbeat()
        self.dog = Watchdog(self.beat) if args.diagnose else None
        self.rows: list[dict] = []
        self.marks: list[tuple[int, int]] = []
        self.latencies: list[float] = []
        self.repeats = max(1, args.prompt_tokens // 40)
        self.events: dict[str, float] = {}
        events = self.events
        w.bridge.model_loaded.connect(lambda _i: events.setdefault("loaded", time.perf_counter()))
        w.bridge.tokens_generated.connect(lambda *_: events.setdefault("first_token", time.perf_counter()))
        w.bridge.generation_finished.connect(lambda *_: events.__setitem__("finished", time.perf_counter()))
        w.bridge.generation_started.connect(lambda *_: events.setdefault("started", time.perf_counter()))
        self.saves: list[tuple[float, int]] = []      # (when, size) of every checkpoint saved
        w.bridge.checkpoint_saved.connect(lambda *a: self.saves.append((time.perf_counter(), a[2])))
        self.wait(lambda: len(self.beat.ticks) > 20, 5)

    def wait(self, predicate, timeout: float) -> None:
        wait_until(self.app, predicate, timeout)

    def phase(self, name: str, start: int, seconds: float, note: str = "", **extra) -> None:
        # only bookkeeping here: the statistics are computed after the run, because
        # sorting thousands of gaps on the UI thread would itself stall the next phase
        self.marks.append((start, self.beat.mark()))
        self.rows.append(dict(phase=name, seconds=seconds, note=note, **extra))

    def saved_after(self, key: str) -> tuple[float, int] | None:
        """The first save after ``events[key]`` (a long prompt is saved before its answer)."""
        return next((s for s in self.saves if key in self.events and s[0] >= self.events[key]), None)

    def sleep(self, seconds: float) -> None:
        t0 = time.perf_counter()
        self.wait(lambda: time.perf_counter() - t0 > seconds, seconds + 7)

    # -- the phases, in the order they run ---------------------------------------------------------
    def baseline(self) -> None:
        """The same heartbeat with the engine idle shows what the machine itself adds."""
        m, t0 = self.beat.mark(), time.perf_counter()
        self.sleep(3.0)
        self.phase("idle (baseline)", m, time.perf_counter() - t0, "no model work; OS scheduling noise")

    def load(self) -> None:
        m, t0 = self.beat.mark(), time.perf_counter()
        self.w.start()
        self.wait(lambda: "loaded" in self.events, 120)
        self.phase("model load", m, self.events["loaded"] - t0, self.w.bridge.model_info.name)
        self.wait(lambda: self.w.worker.idle, 30)

    def long_prompt(self) -> None:
        """Prefill, generation, and saving the large checkpoint after it."""
        w, events = self.w, self.events
        prompt = "Summarise this archive description in one paragraph.\n\n" + PARAGRAPH * self.repeats
        m, t0 = self.beat.mark(), time.perf_counter()
        w.prompt_edit.setPlainText(prompt)
        w.send()
        self.wait(lambda: "first_token" in events, 1200)
        n_prompt = w.context_usage.value()
        self.phase("prefill", m, events["first_token"] - t0, f"{n_prompt:,} prompt tokens",
                   tok_s=n_prompt / (events["first_token"] - t0))
        m = self.beat.mark()
        self.wait(lambda: "finished" in events, 1200)
        summary = w.last_summary
        self.phase("generation", m, events["finished"] - events["first_token"],
                   f"{summary.n_generated} tokens, {summary.tokens_per_s:.1f} tok/s", tok_s=summary.tokens_per_s)
        m = self.beat.mark()
        self.wait(lambda: self.saved_after("finished") is not None, 120)
        when, size = self.saved_after("finished")
        self.phase("save checkpoint", m, when - events["finished"], f"{size / 1e6:.1f} MB")

    def validate_big(self) -> None:
        """Validate a 1 GB checkpoint through the browser."""
        w = self.w
        big = synthesize_big_checkpoint(w.store.folder / "synthetic-1gb.kvckpt")
        browser = w.show_browser()
        self.wait(lambda: any(r.path == big for r in browser.model.rows), 30)
        results: list = []
        w.validation_finished.connect(results.append)
        m, t0 = self.beat.mark(), time.perf_counter()
        w.validate_checkpoint(big)
        self.wait(lambda: bool(results), 600)
        # the synthetic state is random bytes: its CRC passes, its structure does not
        self.phase("validate 1 GB file", m, time.perf_counter() - t0,
                   f"{results[0].status}: {(results[0].reason or 'CRC OK')[:40]}")
        browser.hide()
        big.unlink()   # freeing 1 GB of file is the benchmark's own work, not the app's
        self.sleep(0.2)   # ... and its gap must not open the next phase

    def pause_latency(self, name: str, text: str, trigger: str) -> None:
        """Pause an answer once ``trigger`` happened: its first token, or (``started``) well
        inside its prefill's first chunk."""
        w, events = self.w, self.events
        w.new_conversation()
        for key in ("first_token", "finished", "started"):
            events.pop(key, None)
        m = self.beat.mark()
        w.prompt_edit.setPlainText(text)
        w.send()
        self.wait(lambda: trigger in events, 600)
        if trigger == "started":
            self.wait(lambda: w.speed_label.text().startswith("Reading"), 10)
            self.sleep(0.3)
        w.pause()
        self.wait(lambda: "finished" in events, 120)
        latency = w.pause_latency_s
        self.wait(lambda: self.saved_after("finished") is not None, 120)
        self.phase(name, m, latency, f"{w.last_summary.finish_reason}, saved "
                                     f"{self.saved_after('finished')[1] / 1e6:.1f} MB")
        self.latencies.append(latency)

    def two_answers(self) -> None:
        """Two answers at once (two conversations), then one of them paused."""
        w = self.w
        finished: list = []
        w.bridge.generation_finished.connect(lambda summary: finished.append(summary.conversation_id))
        streamed: set = set()
        w.bridge.tokens_generated.connect(lambda conv, _t: streamed.add(conv))
        ids = []
        w.settings.n_predict = 2000            # both still streaming when one is paused
        for text in ("Tell me a long story about a lighthouse keeper.", "Describe a harbour town at dawn."):
            w.new_conversation()
            ids.append(w.current)
            w.prompt_edit.setPlainText(text)
            w.send()
            self.wait(lambda: w.current in streamed, 600)
        m, t0 = self.beat.mark(), time.perf_counter()
        self.sleep(3.0)
        self.phase("two answers", m, time.perf_counter() - t0, "both streaming")
        m = self.beat.mark()
        w.select_conversation(ids[0])
        w.pause()
        self.wait(lambda: ids[0] in finished, 120)
        latency = w.pause_latency_s
        other = "the other still streaming" if ids[1] not in finished else "the other had ended"
        self.phase("pause one of two", m, latency, other)
        self.wait(lambda: ids[1] in finished, 600)

    def close(self) -> str:
        """Stop the window and the engine; the statistics of every phase; the diagnosis."""
        w = self.w
        w._close_done = True
        w.worker.shutdown()
        w.worker.join(60)
        w.close()
        self.beat.timer.stop()
        spans = []
        for row, (start, end) in zip(self.rows, self.marks, strict=True):
            row["stall_ms"], row["p99_ms"], row["ticks"] = self.beat.stall_ms(start, end)
            spans.append((row["phase"], self.beat.ticks[max(0, start - 1)], self.beat.ticks[max(0, end - 1)]))
        if self.dog is None:
            return ""
        self.dog.stop()
        return self.dog.report(spans)


def run_window(args) -> dict:
    home = Path(tempfile.mkdtemp(prefix="ui-stall-"))
    os.environ["CHECKPOINT_CHAT_HOME"] = str(home)
    label = apply_levers(args)
    wanted = set(args.phases.split(","))
    run = WindowRun(args)
    run.baseline()
    run.load()
    if wanted & {"prefill", "generation", "save", "validate", "pause"}:
        run.long_prompt()
    if "validate" in wanted:
        run.validate_big()
    if "pause" in wanted:
        run.pause_latency("pause (generating)", "Tell me a long story about a lighthouse keeper.", "first_token")
        run.pause_latency("pause (prefill)", "Count the shelves.\n\n" + PARAGRAPH * run.repeats + "\nAgain:",
                          "started")
    if "two" in wanted:
        run.two_answers()
    diagnosis = run.close()
    if not args.keep:
        shutil.rmtree(home, ignore_errors=True)
    return {"levers": label, "threads": args.threads, "rows": run.rows, "pause_latency_s": run.latencies,
            "diagnosis": diagnosis}


def render(result: dict) -> str:
    out = [f"\nUI stall benchmark (offscreen, {result['threads']} engine threads, {os.cpu_count()} CPUs, "
           f"{PERIOD_MS} ms heartbeat; {result['levers']})\n",
           f"| {'phase':<20} | {'duration':>10} | {'longest stall':>13} | {'p99 gap':>8} | {'ticks':>6} | note",
           f"|{'-' * 22}|{'-' * 12}|{'-' * 15}|{'-' * 10}|{'-' * 8}|------"]
    for r in result["rows"]:
        seconds = r["seconds"]
        dur = f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"
        out.append(f"| {r['phase']:<20} | {dur:>10} | {r['stall_ms']:>10.1f} ms | {r['p99_ms']:>5.1f} ms | "
                   f"{r['ticks']:>6} | {r['note']}")
    worst = max(r["stall_ms"] for r in result["rows"])
    out.append(f"\nworst stall: {worst:.1f} ms (target 16 ms); pause click -> tokens stopped: "
               + ", ".join(f"{x * 1000:.0f} ms" for x in result["pause_latency_s"]))
    if result.get("diagnosis"):
        out.append(result["diagnosis"])
    return "\n".join(out)


def wait_for_quiet(max_load: float, patience_s: float = 900.0) -> float:
    """Wait (up to ``patience_s``) until the 1-minute load average is below ``max_load``:
    on a shared machine another process's compute threads would be measured too."""
    deadline = time.monotonic() + patience_s
    while True:
        load = os.getloadavg()[0]
        if load < max_load or time.monotonic() > deadline:
            return load
        time.sleep(10)


def compare(args, argv: list[str]) -> int:
    """Run the window once per configuration, alternating, and print one table.

    Each configuration needs its own process (a thread's priority cannot always be
    raised again).  Rounds alternate the configurations so that a change in the
    machine's load hits all of them alike; the table shows, per phase, the worst
    stall over the rounds and the median speed.
    """
    import json
    import statistics
    import subprocess
    configs = [c.strip() for c in args.compare.split(",") if c.strip()]
    passthrough = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--compare", "--rounds", "--compute-priority", "--max-load"):
            skip = True
            continue
        if a.startswith(("--compare=", "--rounds=", "--compute-priority=", "--max-load=")):
            continue
        passthrough.append(a)
    results: dict[str, list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="ui-stall-compare-") as tmp:
        for r in range(args.rounds):
            for c in (configs if r % 2 == 0 else configs[::-1]):
                load = wait_for_quiet(args.max_load)
                out = Path(tmp) / f"{c}-{r}.json"
                cmd = [sys.executable, str(Path(__file__).resolve()), "--compute-priority", c,
                       "--json", str(out), *passthrough]
                print(f"[round {r + 1}] {c} ...", file=sys.stderr, flush=True)
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0 or not out.exists():
                    print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
                    continue
                result = json.loads(out.read_text())
                result["load"] = (load, os.getloadavg()[0])
                results[c].append(result)
                print(render(result), file=sys.stderr)
    phases = []
    for runs in results.values():
        for run in runs:
            for row in run["rows"]:
                if row["phase"] not in phases:
                    phases.append(row["phase"])
    head = "| phase                |" + "".join(f" {c + ' worst':>12} | {c + ' p99':>10} |" for c in configs)
    print(f"\nUI stall, {' vs '.join(configs)}: worst stall over {args.rounds} alternating rounds (ms), "
          f"max of the per-round p99 gaps (ms); {args.threads} threads, {os.cpu_count()} CPUs")
    print(head)
    print("|" + "-" * (len(head) - 2) + "|")
    for ph in phases:
        cells = ""
        for c in configs:
            rows = [row for run in results[c] for row in run["rows"] if row["phase"] == ph]
            worst = max((row["stall_ms"] for row in rows), default=float("nan"))
            p99 = max((row["p99_ms"] for row in rows), default=float("nan"))
            cells += f" {worst:>12.1f} | {p99:>10.1f} |"
        print(f"| {ph:<20} |" + cells)
    print("1-minute load average before/after each run: " + "; ".join(
        f"{c} " + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in (run["load"] for run in runs))
        for c, runs in results.items()))
    for what in ("prefill", "generation"):
        speeds = {c: [row["tok_s"] for run in results[c] for row in run["rows"]
                      if row["phase"] == what and row.get("tok_s")] for c in configs}
        if all(speeds.values()):
            base = statistics.median(speeds[configs[0]])
            print(f"{what} tok/s (median of rounds): " + ", ".join(
                f"{c} {statistics.median(v):.1f} ({statistics.median(v) / base:.3f}x)" for c, v in speeds.items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--n-predict", type=int, default=96, help="answer length in the generation phase")
    parser.add_argument("--phases", default="prefill,generation,save,validate,pause,two",
                        help="which phases after the model load to run")
    parser.add_argument("--compute-priority", choices=["normal", "low"],
                        help="ContextSettings.compute_priority for the window's context "
                             "(default: the app's own default)")
    parser.add_argument("--nice", type=int, help="Linux nice of low-priority compute threads")
    parser.add_argument("--switch-interval", type=float, default=0, metavar="MS",
                        help="the GIL switch interval (sys.setswitchinterval; Python default 5 ms)")
    parser.add_argument("--batch", type=int, help="n_batch = n_ubatch (prefill chunk size)")
    parser.add_argument("--diagnose", action="store_true", help="stacks of every thread at late heartbeats")
    parser.add_argument("--compare", metavar="A,B", help="run these compute priorities alternately")
    parser.add_argument("--rounds", type=int, default=2, help="with --compare: rounds of each")
    parser.add_argument("--max-load", type=float, default=0.8,
                        help="with --compare: wait for a 1-minute load average below this before each run")
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the temporary app home")
    args = parser.parse_args(argv)
    if args.compare:
        return compare(args, argv)
    result = run_window(args)
    print(render(result))
    if args.json:
        import json
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
