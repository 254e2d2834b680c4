"""GPU checks for installer/gpu_check.sh (runs on CPU too, at small sizes).

1. The determinism contract across processes, through the real CLI: "generate N" vs
   "generate k, pause, save, exit; new process: load, generate N-k" at --temp 0.8.
2. Time to first token, recompute (prefill the prompt) vs restore (read the checkpoint,
   set the state, sample), each in a fresh Runtime, for each context size.
3. Pause latency: from request_pause() on another thread to generate() returning,
   during token generation and during prefill, and the save that follows.

    python installer/gpu_bench.py --model M.gguf --ngl 99 --sizes 8192,32768
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FILLER = ("The archive kept its records in long corridors of numbered shelves. Each morning "
          "the keeper walked the rows, noting which volumes had moved, which were missing, "
          "and which had been returned with notes in the margins about rivers, harvests, "
          "weather and the prices of salt in the years {i} and {j}. ")


def cli(*args: str, timeout: float = 600) -> dict:
    done = subprocess.run([sys.executable, "-m", "engine.cli", "run", *args, "--json"],
                          capture_output=True, text=True, cwd=str(ROOT), timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"checkpoint-chat run {' '.join(args)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def determinism(model: str, ngl: int, n: int, k: int, work: Path) -> bool:
    common = ["--model", model, "-ngl", str(ngl), "--seed", "1", "--temp", "0.8"]
    prompt = ["--prompt", "Write a short story about a lighthouse keeper."]
    full = cli(*common, *prompt, "-n", str(n))
    ckpt = work / "contract.kvckpt"
    first = cli(*common, *prompt, "-n", str(n), "--stop-after", str(k), "--checkpoint-save", str(ckpt))
    rest = cli("--checkpoint-load", str(ckpt), "-ngl", str(ngl))
    joined = first["text"] + rest["text"]
    same = joined == full["text"]
    print(f"determinism (temp 0.8, seed 1, {n} tokens, pause after {k}, new process): "
          f"{'IDENTICAL' if same else 'DIFFERENT'}")
    if not same:
        print(f"  uninterrupted: {full['text']!r}\n  paused+resumed: {joined!r}")
    return same


def prompt_of(model, n_tokens: int) -> str:
    text, i = "", 0
    while True:
        chunk = "".join(FILLER.format(i=1000 + i + j, j=2000 + 3 * (i + j)) for j in range(20))
        if len(model.tokenize(text + chunk, add_special=False)) > n_tokens:
            break
        text += chunk
        i += 20
    words = chunk.split(" ")
    while words and len(model.tokenize(text + " ".join(words), add_special=False)) > n_tokens:
        words = words[: max(0, len(words) - 8)]
    return text + " ".join(words)


def ttft(model_path: str, ngl: int, size: int, work: Path) -> dict:
    from engine.checkpoints import format as fmt
    from engine.checkpoints.format import KIND_PAUSE
    from engine.conversation import Conversation
    from engine.generation import begin_answer, commit_answer, generate
    from engine.runtime import Runtime
    from engine.sampling import SamplerSettings
    from native.context import ContextSettings

    settings = ContextSettings(n_ctx=size, n_batch=2048, n_ubatch=512)
    rt = Runtime(model_path, settings, n_gpu_layers=ngl)
    text = prompt_of(rt.model, size - 300)
    conv = Conversation(sampler=SamplerSettings(seed=1, temperature=0.8, ignore_eos=True))
    begin_answer(conv, rt, "Summarise:\n" + text, n_predict=4)
    t0 = time.perf_counter()
    res = generate(rt, conv, stop_after=1)
    recompute = time.perf_counter() - t0
    commit_answer(conv)
    path = work / f"ttft-{size}.kvckpt"
    t0 = time.perf_counter()
    info = rt.save(path, conv, KIND_PAUSE)
    save = time.perf_counter() - t0
    n_tokens = len(conv.tokens)
    rt.close()

    rt2 = Runtime(model_path, settings, n_gpu_layers=ngl)
    t0 = time.perf_counter()
    conv2 = rt2.restore(fmt.read_checkpoint(path))
    res2 = generate(rt2, conv2, stop_after=1)
    restore = time.perf_counter() - t0
    rt2.close()
    return {"size": size, "n_tokens": n_tokens, "recompute_s": recompute, "restore_s": restore,
            "ratio": recompute / restore if restore else float("inf"), "save_s": save,
            "file_mb": info.size / 1e6, "first_token_recompute": res.text,
            "first_token_restore": res2.text}


def _collect(into: list, fn, *args, **kwargs) -> None:
    into.append(fn(*args, **kwargs))


class _UnderWay:
    """A generation listener whose ``seen`` is set once the phase to pause is under way."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.seen = threading.Event()
        self.count = 0

    def on_prefill_progress(self, done, total):
        if self.phase == "prefill" and done > 0:
            self.seen.set()

    def on_text(self, delta):
        self.count += 1
        if self.phase == "prefill" or self.count >= 20:  # prefill done before we looked
            self.seen.set()


def pause_latency(model_path: str, ngl: int, size: int, work: Path) -> dict:
    from engine.checkpoints.format import KIND_PAUSE
    from engine.conversation import Conversation
    from engine.generation import Control, begin_answer, commit_answer, generate
    from engine.runtime import Runtime
    from engine.sampling import SamplerSettings
    from native.context import ContextSettings

    rt = Runtime(model_path, ContextSettings(n_ctx=size, n_batch=512, n_ubatch=512), n_gpu_layers=ngl)
    text = prompt_of(rt.model, size - 600)
    out = {}
    for phase in ("prefill", "decode"):
        conv = Conversation(sampler=SamplerSettings(seed=1, temperature=0.8, ignore_eos=True))
        rt.trim(0)
        begin_answer(conv, rt, ("Summarise:\n" + text) if phase == "prefill" else "Count to 500.",
                     n_predict=400)
        control = Control()
        listener = _UnderWay(phase)
        result: list = []
        worker = threading.Thread(target=_collect, args=(result, generate, rt, conv),
                                  kwargs={"control": control, "listener": listener})
        worker.start()
        listener.seen.wait(300)
        t0 = time.perf_counter()
        control.request_pause()
        worker.join()
        paused = time.perf_counter() - t0
        commit_answer(conv)
        t1 = time.perf_counter()
        rt.save(work / f"pause-{phase}.kvckpt", conv, KIND_PAUSE)
        out[phase] = {"pause_s": paused, "save_s": time.perf_counter() - t1,
                      "paused": bool(result and result[0].paused)}
    rt.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ngl", type=int, default=99)
    ap.add_argument("--sizes", default="8192,32768")
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--skip", default="", help="comma list of: contract,ttft,pause")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    os.environ.setdefault("CHECKPOINT_CHAT_HOME", tempfile.mkdtemp(prefix="ccgpu-home-"))
    work = Path(tempfile.mkdtemp(prefix="ccgpu-"))
    from native.library import system_info
    info = system_info()
    print(f"library {info.library_path}\nGPU offload {info.gpu_offload}; devices: "
          + "; ".join(f"{d.kind} {d.description} {d.memory_free / 2**30:.1f} GiB free" for d in info.devices))
    ok = True
    if "contract" not in skip:
        ok = determinism(args.model, args.ngl, args.n, args.k, work) and ok
    if "ttft" not in skip:
        print(f"{'context':>8} {'tokens':>7} {'recompute s':>12} {'restore s':>10} {'ratio':>7} "
              f"{'save s':>7} {'file MB':>8}")
        for size in (int(s) for s in args.sizes.split(",")):
            r = ttft(args.model, args.ngl, size, work)
            print(f"{r['size']:>8} {r['n_tokens']:>7} {r['recompute_s']:>12.3f} {r['restore_s']:>10.3f} "
                  f"{r['ratio']:>7.1f} {r['save_s']:>7.3f} {r['file_mb']:>8.1f}", flush=True)
    if "pause" not in skip:
        size = int(args.sizes.split(",")[-1])
        for phase, r in pause_latency(args.model, args.ngl, size, work).items():
            print(f"pause during {phase}: {r['pause_s'] * 1000:.1f} ms to stop, "
                  f"{r['save_s'] * 1000:.1f} ms to save (paused={r['paused']})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
