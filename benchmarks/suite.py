"""The benchmark suite of issues 2 and 5: ``python -m benchmarks``.

    python -m benchmarks [--quick] [--models smollm,gemma] [--sizes 512,2048,8192]
                         [--sections a,b,c,d,e,f,g] [--threads 2] [--json out.json]

Sections (issue 5): a. time to first token, restore vs recompute vs the raw floor;
b. save / load vs raw file I/O, checkpoint size vs theoretical KV bytes; c. generation
speed with autosave (full, delta); d. tokens/s vs llama-cpp-python's ``Llama`` and a
bare ctypes loop; e. pause latency; f. peak memory during save and load; g. (issue 10)
switching between alternatives and editing a turn vs re-decoding, and the disk of five
alternatives (SmolLM2 only).  a, b and f share one measurement pass per context length.

Prints the tables, then every target of issues 2 and 5 with the measured value, and
writes everything as JSON.  Exits 0 whatever the numbers are: a benchmark reports,
it does not judge (the shared 2-core machines are far too noisy for that).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import autosave_cost, branches, pause, restore, throughput
from benchmarks.common import MODEL_KEYS, Table, context_settings, ctx_size_for, model_path
from benchmarks.targets import evaluate

SECTIONS = "abcdefg"


@dataclass
class Config:
    models: list[str] = field(default_factory=lambda: list(MODEL_KEYS))
    sizes: list[int] = field(default_factory=lambda: [512, 2048, 8192])
    sections: str = SECTIONS
    threads: int = 2
    repeats: int = 5                 # restore / save / load trials per size
    autosave_context: int = 2048
    autosave_tokens: int = 512
    autosave_every: list[int] = field(default_factory=lambda: [16, 64, 256])
    tp_prompt: int = 1024
    tp_tokens: int = 256
    tp_repeats: int = 3
    tp_reference: bool = True        # the f16 / no flash attention row
    pause_context: int = 2048
    pause_trials: int = 6
    pause_delay: tuple[float, float] = (0.4, 1.2)
    branch_tokens: int = 4000        # g: the conversation whose alternatives are switched
    branch_answer: int = 48
    mode: str = "full"


def quick_config() -> Config:
    return Config(sizes=[512], repeats=3, autosave_context=256, autosave_tokens=128,
                  autosave_every=[16, 64], tp_prompt=256, tp_tokens=48, tp_repeats=2,
                  pause_context=1024, pause_trials=3, branch_tokens=1000, branch_answer=24, mode="quick")


def smoke_config() -> Config:
    """The smallest configuration that exercises every section (a few seconds)."""
    return Config(models=["smollm"], sizes=[48], repeats=1, autosave_context=32, autosave_tokens=16,
                  autosave_every=[8], tp_prompt=32, tp_tokens=8, tp_repeats=1, tp_reference=False,
                  pause_context=256, pause_trials=1, pause_delay=(0.05, 0.0), branch_tokens=200,
                  branch_answer=8, mode="smoke",
                  threads=1)   # one thread: no spinning barrier to starve when the machine is busy


def run(cfg: Config, *, echo=print, partial: Path | None = None) -> dict:
    """Run the configured sections; returns the JSON-ready report.

    With ``partial``, the report so far is written there after every section, so a long
    run that is stopped still leaves its finished tables behind.
    """
    from engine.runtime import Runtime
    tables: dict[str, Table] = {}
    if set("abf") & set(cfg.sections):
        tables.update(restore.tables())
    if "c" in cfg.sections:
        tables["autosave"] = autosave_cost.table()
    if "d" in cfg.sections:
        tables["throughput"] = throughput.table()
    if "e" in cfg.sections:
        tables["pause"] = pause.table()
    if "g" in cfg.sections:
        tables["branches"] = branches.table()
    started = time.perf_counter()

    def checkpoint(what: str) -> None:
        echo(f"    {what} done at {time.perf_counter() - started:.0f} s", file=sys.stderr)
        if partial is not None:
            partial.write_text(json.dumps(_report(cfg, tables, started), indent=1, default=str),
                               encoding="utf-8")

    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        folder = Path(tmp)
        for key in cfg.models:
            path = model_path(key)
            need = max([0] + (cfg.sizes if set("abf") & set(cfg.sections) else [])
                       + [cfg.autosave_context + cfg.autosave_tokens + 8, cfg.pause_context])
            rt = Runtime(path, context_settings(ctx_size_for(need), cfg.threads))
            try:
                if set("abf") & set(cfg.sections):
                    for n in cfg.sizes:
                        echo(f"[{key}] a/b/f: {n} tokens ...", file=sys.stderr)
                        restore.measure(rt, key, n, folder, cfg.repeats, tables)
                        checkpoint(f"{key} a/b/f {n}")
                if "c" in cfg.sections:
                    echo(f"[{key}] c: autosave ...", file=sys.stderr)
                    autosave_cost.measure(rt, key, cfg.autosave_context, cfg.autosave_tokens,
                                          cfg.autosave_every, folder, tables["autosave"])
                    checkpoint(f"{key} c")
                if "e" in cfg.sections:
                    echo(f"[{key}] e: pause ...", file=sys.stderr)
                    pause.measure(rt, key, cfg.pause_context, cfg.pause_trials, folder, tables["pause"],
                                  delay=cfg.pause_delay)
                    checkpoint(f"{key} e")
            finally:
                rt.close()
            if "d" in cfg.sections:
                variants = [dict(flash_attn=True, kv_type=8)]
                if cfg.tp_reference:
                    variants.append(dict(flash_attn=False, kv_type=1))
                for v in variants:
                    echo(f"[{key}] d: throughput {v} ...", file=sys.stderr)
                    trt = Runtime(path, context_settings(ctx_size_for(cfg.tp_prompt + cfg.tp_tokens),
                                                         cfg.threads, **v))
                    try:
                        throughput.measure(trt, key, path, cfg.tp_prompt, cfg.tp_tokens, cfg.tp_repeats,
                                           tables["throughput"])
                    finally:
                        trt.close()
                    checkpoint(f"{key} d")
    if "g" in cfg.sections:
        echo(f"[smollm] g: branches, {cfg.branch_tokens} tokens ...", file=sys.stderr)
        branches.measure(tables["branches"], cfg.branch_tokens, cfg.branch_answer, cfg.threads,
                         repeats=1 if cfg.mode == "smoke" else 3)
        checkpoint("g")
    return _report(cfg, tables, started)


def _report(cfg: Config, tables: dict[str, Table], started: float) -> dict:
    report = {
        "config": {**cfg.__dict__, "pause_delay": list(cfg.pause_delay)},
        "machine": {"python": sys.version.split()[0], "platform": platform.platform(),
                    "cpus": os.cpu_count(), "load_avg_at_end": _loadavg()},
        "seconds": time.perf_counter() - started,
        "tables": {name: t.to_json() for name, t in tables.items()},
    }
    report["targets"] = evaluate(report["tables"])
    return report


def _loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def render(report: dict) -> str:
    parts = []
    for data in report["tables"].values():
        t = Table(data["title"], data["columns"], data["rows"], data["notes"])
        parts.append(t.render())
    targets = Table("Targets (issues 2, 5 and 10)", ["issue", "target", "model", "at", "wanted", "measured", "met"],
                    report["targets"])
    parts.append(targets.render())
    return "\n\n".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (about three minutes)")
    parser.add_argument("--smoke", action="store_true", help="the smallest configuration (seconds)")
    parser.add_argument("--models", help=f"comma-separated, from {','.join(MODEL_KEYS)}")
    parser.add_argument("--sizes", help="context lengths for a/b/f, e.g. 512,2048,8192,32768")
    parser.add_argument("--sections", help=f"subset of {SECTIONS}")
    parser.add_argument("--threads", type=int, help="llama.cpp threads (default 2)")
    parser.add_argument("--autosave", metavar="CONTEXT,TOKENS", help="section c sizes, e.g. 2048,512")
    parser.add_argument("--throughput", metavar="PROMPT,TOKENS,REPEATS", help="section d sizes, e.g. 1024,256,3")
    parser.add_argument("--json", metavar="PATH", help="write the report here")
    args = parser.parse_args(argv)
    cfg = smoke_config() if args.smoke else quick_config() if args.quick else Config()
    if args.models:
        cfg.models = [m.strip() for m in args.models.split(",") if m.strip()]
        for m in cfg.models:
            if m not in MODEL_KEYS:
                parser.error(f"unknown model {m!r}; choose from {', '.join(MODEL_KEYS)}")
    if args.sizes:
        cfg.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if args.sections:
        cfg.sections = "".join(c for c in args.sections.lower() if c in SECTIONS)
    if args.threads:
        cfg.threads = args.threads
    if args.autosave:
        cfg.autosave_context, cfg.autosave_tokens = (int(x) for x in args.autosave.split(","))
    if args.throughput:
        cfg.tp_prompt, cfg.tp_tokens, cfg.tp_repeats = (int(x) for x in args.throughput.split(","))
    report = run(cfg, echo=print, partial=Path(args.json) if args.json else None)
    print(render(report))
    print(f"\n({report['seconds']:.0f} s, load average at the end {report['machine']['load_avg_at_end']})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
        print(f"JSON written to {args.json}")
    return 0
