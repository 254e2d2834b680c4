"""What forked workers do (see faultkit.zygote).  Each role is one function.

A writer appends one line to its ack file *after* each save has returned, so the test
knows which saves completed: after a SIGKILL a conversation's file must hold the last
acknowledged save or the one that was in flight, nothing else.

Ack lines: ``A <conv> <seq>`` (autosave), ``M <file name> <conv> <seq>`` (manual save).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from engine.checkpoints import format as fmt
from engine.checkpoints.store import Store
from engine.errors import CheckpointError
from faultkit import synthetic


class Acks:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def __call__(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode("utf-8"))   # one write: never interleaved


def run(spec: dict) -> None:
    ROLES[spec["role"]](spec)


def kill_writer(spec: dict) -> None:
    """Save forever, round-robin over conversations, until killed."""
    store = Store(spec["folder"])
    convs = [uuid.UUID(c) for c in spec["convs"]]
    seqs = list(spec["next_seq"])
    ack = Acks(spec["ack"])
    i = spec.get("start", 0)
    while True:
        c = i % len(convs)
        synthetic.write(synthetic.fixed_path(store, convs[c]), convs[c], seqs[c])
        ack(f"A {c} {seqs[c]}")
        if i % 3 == 2:
            path = store.new_path(f"manual 保存 {c}")
            synthetic.write(path, convs[c], seqs[c], kind=fmt.KIND_MANUAL, title=f"manual {c}",
                            line=uuid.uuid4().hex)   # a head of its own: kept by any prune
            ack(f"M {path.name} {c} {seqs[c]}")
        seqs[c] += 1
        i += 1


def model_writer(spec: dict) -> None:
    """Load SmolLM2, prefill a prompt, then save the real KV state forever."""
    from engine.conversation import Conversation
    from engine.generation import begin_answer
    from engine.runtime import Runtime
    from native.context import ContextSettings
    rt = Runtime(spec["model"], ContextSettings(n_ctx=spec["n_ctx"], n_threads=1))
    conv = Conversation(id=uuid.UUID(spec["conv"]))
    begin_answer(conv, rt, spec["prompt"], n_predict=16)
    rt.prefill(conv.tokens)
    store = Store(spec["folder"])
    ack = Acks(spec["ack"])
    ack("READY")
    seq = spec["next_seq"]
    while True:
        conv.answer.n_generated = seq % 8   # makes each version tell-apart in the header
        rt.save(synthetic.fixed_path(store, conv.id), conv, fmt.KIND_AUTOSAVE)
        ack(f"A 0 {seq}")
        seq += 1


def writer(spec: dict) -> None:
    """``n_saves`` saves: own autosave, a shared autosave, uniquely named manual saves (each
    a line of its own), and a line of history whose older files the pruner may delete."""
    store = Store(spec["folder"])
    w = spec["writer"]
    own, shared = uuid.UUID(spec["own"]), uuid.UUID(spec["shared"])
    ack = Acks(spec["ack"])
    for seq in range(1, spec["n_saves"] + 1):
        if seq % 4 == 0:
            synthetic.write(synthetic.fixed_path(store, shared), shared, seq, writer=w,
                            n_tokens=16 + seq % 64, durable=False)
            ack(f"S {w} {seq}")
        elif seq % 4 == 2:
            # the same title from every writer in the same second: names must still differ
            path = store.new_path("same title")
            synthetic.write(path, own, seq, kind=fmt.KIND_MANUAL, writer=w,
                            n_tokens=16 + seq % 64, durable=False, line=uuid.uuid4().hex)
            ack(f"M {path.name} {w} {seq}")
        elif seq % 4 == 3:
            # a line whose every save is a new file: each supersedes the one before
            path = store.new_autosave_path(own)
            synthetic.write(path, own, seq, writer=w, n_tokens=16 + seq % 64, durable=False,
                            line=f"history-{w}")
            ack(f"H {path.name} {w} {seq}")
        else:
            synthetic.write(synthetic.fixed_path(store, own), own, seq, writer=w,
                            n_tokens=16 + seq % 64, durable=False)
            ack(f"A {w} {seq}")


def reader(spec: dict) -> None:
    """List and fully validate the store until the stop file appears."""
    store = Store(spec["folder"])
    stop = Path(spec["stop"])
    stats = {"listings": 0, "validated": 0, "vanished": 0, "failures": []}
    while True:
        stopping = stop.exists()   # one more full pass after the writers finished
        for entry in store.entries():
            if not entry.valid:
                stats["failures"].append(f"{entry.path.name}: listed with a bad header: {entry.error}")
                continue
            try:
                checked = synthetic.load_fully(entry.path)
            except FileNotFoundError:
                stats["vanished"] += 1   # pruned between the listing and the open
                continue
            except CheckpointError as exc:
                stats["failures"].append(f"{entry.path.name}: {type(exc).__name__}: {exc}")
                continue
            if checked.meta.get("conversation") != str(checked.header.conversation_id):
                stats["failures"].append(f"{entry.path.name}: metadata of another save")
            stats["validated"] += 1
        stats["listings"] += 1
        if stopping:
            break
    Path(spec["result"]).write_text(json.dumps(stats), "utf-8")


def pruner(spec: dict) -> None:
    """Prune the store to a small budget until the stop file appears."""
    from engine.checkpoints import graph
    store = Store(spec["folder"])
    stop = Path(spec["stop"])
    stats = {"prunes": 0, "deleted": 0, "skipped_changed": 0}
    while not stop.exists():
        report = graph.prune(store, spec["budget"], stale_temp_age_s=3600)
        stats["prunes"] += 1
        stats["deleted"] += len(report.deleted)
        stats["skipped_changed"] += report.skipped_changed
        time.sleep(0.005)
    Path(spec["result"]).write_text(json.dumps(stats), "utf-8")


ROLES = {"kill-writer": kill_writer, "model-writer": model_writer, "writer": writer,
         "reader": reader, "pruner": pruner}
