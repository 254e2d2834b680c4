"""Store bytes against the KV state they hold: today's layout vs the layout before issue 25.

``python -m benchmarks.store_footprint [--models smollm,gemma,lfm2,qwen35,mamba2] [--conversations 10]``

Side by side in one process, on the same model and the same conversations:

* **before**: every checkpoint carries its last position's logits, and every
  conversation's first checkpoint is a full file (the rules before shared prefixes);
* **now**: logits only where re-decoding the last token would not give them exactly
  (engine.runtime.logits_rule), and a long system prompt stored once
  (engine.shared_prefix).

Cases: (1) an 18-token prompt and 256 generated tokens, autosave every 16 (the CLI's
default chain, head written at the end); (2) ``--conversations`` conversations sharing a
~1,500-token system prompt, each with its own question and a 16-token answer; (3) as many
conversations whose first message is the same ~1,500-token document and then a question,
started as the window starts one (from the store's longest stored prefix): *before* writes
each one's first file whole, *now* cuts it from the first conversation's file
(engine.history.LineWriter._cut: a plain attention memory), or, for a memory that cannot
cut (a recurrent part, a sliding window), the second conversation stores the document's
prefix once and the others start from it (engine.prefix_reuse.shareable_end).  The KV
bytes a store must hold at the least are measured from llama.cpp's own state of the
tokens (one sequence, no logits): for case 2, one system prompt plus each conversation's
own tokens (llama.cpp's state of the positions after the system prompt: for a sliding
window the window's cells there, for a recurrent or hybrid model also its whole recurrent
state, which exists only at its end).  ``lfm2``, ``qwen35`` and ``mamba2`` are the tiny
random-weight models of tests/tinymodels.py (8 layers for the hybrids, SmolLM2's 49k
vocabulary): their states are tiny, so the per-file logits (196 KB, kept in each head of
a recurrent model: nothing can decode its last token again) weigh most.  Prints tables
and exits 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from benchmarks.common import MODEL_KEYS, Table, context_settings, model_path

TINY = {"lfm2": 8, "qwen35": 8, "mamba2": 4}   # tests/tinymodels.py, with these layer counts

MB = 1e6
SYSTEM = ("You are the support assistant of Northwind Shipping. Answer in two sentences, cite the "
          "policy section you rely on, and never invent tracking numbers. ")
QUESTIONS = ("Where is my parcel?", "How do I return an item?", "What does express delivery cost?",
             "Can I change the delivery address?", "Do you ship to Norway?", "My parcel arrived damaged.",
             "How long does standard delivery take?", "Can I pick up at a depot?",
             "Is Saturday delivery possible?", "How do I print a label?")


@contextmanager
def layout_before():
    """The rules before issue 25: logits in every file, no shared prefix."""
    import engine.history as history
    import engine.runtime as runtime
    saved = runtime.logits_rule, history.shared_base
    runtime.logits_rule = lambda kind, paused, has_logits, alone, shape: has_logits
    history.shared_base = lambda *args: None
    try:
        yield
    finally:
        runtime.logits_rule, history.shared_base = saved


@contextmanager
def no_cuts():
    """Every conversation's first file whole, as before cut deltas (2026-12-04), and no
    document prefix shared by a memory that cannot cut (before 2026-12-07's
    twenty-seventh session: engine.prefix_reuse.shareable_end)."""
    import engine.history as history
    import engine.prefix_reuse as prefix_reuse
    saved = history.LineWriter._cut, prefix_reuse.shareable_end
    history.LineWriter._cut = lambda self, tip, idx: None
    prefix_reuse.shareable_end = lambda *args: 0
    try:
        yield
    finally:
        history.LineWriter._cut, prefix_reuse.shareable_end = saved


def store_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.kvckpt"))


def state_bytes(rt, n: int, first: int = 0) -> int:
    """llama.cpp's state of the cache's positions ``first..n-1`` (what a store must hold:
    a sliding window's state holds the window before ``n``, a recurrent one its whole
    state)."""
    if n == len(rt.kv_tokens) and not first:
        return rt.ctx.state_size(0)
    rt.ctx.seq_cp(0, 1, first, n)
    try:
        return rt.ctx.state_size(1)
    finally:
        rt.ctx.seq_rm(1, -1, -1)


def model_for(key: str, folder: Path) -> Path:
    if key not in TINY:
        return model_path(key)
    extra = Path(__file__).resolve().parent.parent / "tests"
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))
    import tinymodels
    return tinymodels.cached(key, folder / "models", n_layer=TINY[key])


def autosave_case(rt, folder: Path) -> tuple[int, int, int]:
    """(store bytes, KV bytes, files) of one short prompt + 256-token answer, autosaves every 16."""
    from engine.checkpoints.format import KIND_MANUAL
    from engine.checkpoints.store import Store
    from engine.conversation import Conversation
    from engine.generation import begin_answer, generate
    from engine.history import LineWriter
    from engine.sampling import SamplerSettings
    rt.trim(0)
    conv = Conversation(sampler=SamplerSettings(temperature=0.0, ignore_eos=True))
    begin_answer(conv, rt, "Write a long story about a lighthouse keeper.", n_predict=256)
    writer = LineWriter.starting(rt, Store(folder), conv.id.hex)
    generate(rt, conv, autosave=writer, autosave_every=16)
    writer.save_head(conv, KIND_MANUAL)
    writer.close()
    return store_bytes(folder), state_bytes(rt, len(rt.kv_tokens)), len(list(folder.glob("*.kvckpt")))


def shared_case(rt, folder: Path, n: int) -> tuple[int, int, int]:
    """(store bytes, floor KV bytes, system prompt tokens) of ``n`` conversations on one system prompt."""
    from engine.checkpoints.format import KIND_MANUAL
    from engine.checkpoints.store import Store
    from engine.conversation import Conversation
    from engine.generation import begin_answer, generate
    from engine.history import LineWriter
    from engine.sampling import SamplerSettings
    from engine.shared_prefix import system_prompt_end
    system = SYSTEM * 52   # about 1,500 tokens
    floor = 0
    n_system = 0
    for i in range(n):
        rt.trim(0)
        conv = Conversation(system_prompt=system, sampler=SamplerSettings(temperature=0.0))
        begin_answer(conv, rt, QUESTIONS[i % len(QUESTIONS)] + f" (ticket {i})", n_predict=16)
        writer = LineWriter.starting(rt, Store(folder), conv.id.hex)
        generate(rt, conv, autosave=writer, autosave_every=0)
        writer.save_head(conv, KIND_MANUAL)
        writer.close()
        n_system = system_prompt_end(rt, conv)
        # the first holds the whole state; each other one only what follows the prompt
        floor += state_bytes(rt, len(rt.kv_tokens), 0 if i == 0 else n_system)
    return store_bytes(folder), floor, n_system


def document_case(rt, folder: Path, n: int) -> tuple[int, int, int, int]:
    """(store bytes, floor KV bytes, tokens shared, prompt tokens decoded) of ``n``
    conversations on one document."""
    from engine.checkpoints.chain import common_prefix
    from engine.checkpoints.format import KIND_MANUAL
    from engine.checkpoints.store import Store
    from engine.conversation import Conversation
    from engine.generation import begin_answer, generate
    from engine.prefix_reuse import start_from_stored_prefix
    from engine.sampling import SamplerSettings
    document = "Shipment log:\n" + " ".join(f"parcel {i} left depot {i % 9} on day {i * 7 % 31};"
                                            for i in range(130))   # about 1,500 tokens
    floor, first, shared, decoded = 0, None, 0, 0
    for i in range(n):
        rt.trim(0)   # each conversation in a sequence of its own, as the window's are
        conv = Conversation(system_prompt="", sampler=SamplerSettings(temperature=0.0))
        begin_answer(conv, rt, document + "\n\n" + QUESTIONS[i % len(QUESTIONS)] + f" (ticket {i})", n_predict=16)
        writer = start_from_stored_prefix(rt, Store(folder), conv)
        # as the window saves: an autosave every 64 tokens and the prompt's own checkpoint (a
        # cut is made from it, never from a conversation's head: LineWriter._cut)
        decoded += generate(rt, conv, autosave=writer, autosave_every=64,
                            checkpoint_prompt=writer.policy.prompt_checkpoint).n_prefilled
        writer.save_head(conv, KIND_MANUAL)
        writer.close()
        if first is None:
            first = list(rt.kv_tokens)
        shared = common_prefix(first, rt.kv_tokens) if i else 0
        floor += state_bytes(rt, len(rt.kv_tokens), shared)
    return store_bytes(folder), floor, common_prefix(first or [], rt.kv_tokens), decoded


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODEL_KEYS))
    parser.add_argument("--conversations", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    from engine.runtime import Runtime
    auto = Table("1. One answer (a short prompt + 256 tokens, autosave every 16): store bytes / KV bytes",
                 ["model", "kv_MB", "before_MB", "before_x", "now_MB", "now_x", "files"])
    shared = Table(f"2. {args.conversations} conversations on one system prompt: store bytes / (one prompt + "
                   "their own tokens)", ["model", "system_tokens", "floor_MB", "before_MB", "before_x",
                                         "now_MB", "now_x"])
    documents = Table(f"3. {args.conversations} conversations on one document in the first message: store "
                      "bytes / (one document + their own tokens)",
                      ["model", "shared_tokens", "floor_MB", "before_MB", "before_x", "now_MB", "now_x",
                       "read_before", "read_now"])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for key in args.models.split(","):
            rt = Runtime(model_for(key, root), context_settings(4096, args.threads))
            try:
                with layout_before():
                    before, kv, _ = autosave_case(rt, root / key / "auto-before")
                now, kv_now, files = autosave_case(rt, root / key / "auto-now")
                auto.add(model=key, kv_MB=kv / MB, before_MB=before / MB, before_x=before / kv,
                         now_MB=now / MB, now_x=now / kv_now, files=files)
                with layout_before():
                    before, floor, _ = shared_case(rt, root / key / "shared-before", args.conversations)
                now, floor_now, n_system = shared_case(rt, root / key / "shared-now", args.conversations)
                shared.add(model=key, system_tokens=n_system, floor_MB=floor_now / MB, before_MB=before / MB,
                           before_x=before / floor, now_MB=now / MB, now_x=now / floor_now)
                with no_cuts():
                    before, floor, _, read_before = document_case(rt, root / key / "doc-before",
                                                                   args.conversations)
                now, floor_now, n_doc, read_now = document_case(rt, root / key / "doc-now", args.conversations)
                documents.add(model=key, shared_tokens=n_doc, floor_MB=floor_now / MB, before_MB=before / MB,
                              before_x=before / floor, now_MB=now / MB, now_x=now / floor_now,
                              read_before=read_before, read_now=read_now)
            finally:
                rt.close()
    auto.notes.append("kv: llama.cpp's state of the final cache (one sequence, q8_0 K/V, no logits)")
    shared.notes.append("floor: the first conversation's state + each other one's state after the system "
                        "prompt (llama.cpp's own: a sliding window's cells there, a recurrent state whole); "
                        "no logits")
    print(auto.render())
    print()
    print(shared.render())
    print()
    documents.notes.append("read: prompt tokens decoded by all the conversations together")
    print(documents.render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
