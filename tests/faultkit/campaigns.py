"""Fault campaigns shared by the test suite (bounded) and benchmarks/reliability.py (soak).

Each campaign breaks things many times and returns counts; ``problems`` lists every
violated promise in words, so a test asserts it is empty and the benchmark prints it.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from engine.checkpoints.store import Store
from engine.errors import CheckpointError
from faultkit import synthetic
from faultkit.zygote import Zygote


@dataclass
class KillStats:
    kills: int = 0               # writers that died by SIGKILL (not by their own exit)
    saves_acked: int = 0
    checkpoints_checked: int = 0
    temps_left: int = 0          # half-written temp files found after kills (and removed)
    lost: int = 0                # conversations whose previous and new version were both gone
    problems: list[str] = field(default_factory=list)


def _read_acks(path: Path) -> list[list[str]]:
    if not path.exists():
        return []
    return [line.split(" ") for line in path.read_text("utf-8").splitlines() if line]


def kill_campaign(folder: Path, n_kills: int, *, seed: int = 0, n_convs: int = 3,
                  max_delay_s: float = 0.04, zygote: Zygote) -> KillStats:
    """SIGKILL a synthetic writer ``n_kills`` times at random moments; check after each."""
    rng = random.Random(seed)
    store = Store(folder)
    store.ensure()
    convs = [uuid.UUID(int=rng.getrandbits(128)) for _ in range(n_convs)]
    next_seq = [1] * n_convs
    on_disk: list[int | None] = [None] * n_convs   # the save each autosave file held last check
    stats = KillStats()
    work = folder.parent / f"{folder.name}-acks"
    work.mkdir(parents=True, exist_ok=True)
    for k in range(n_kills):
        ack = work / f"kill-{k}.ack"
        spec = {"role": "kill-writer", "folder": str(folder), "convs": [c.hex for c in convs],
                "next_seq": next_seq, "ack": str(ack), "start": k,
                "error_log": str(work / "errors.log")}
        pid = zygote.spawn(spec)
        time.sleep(rng.uniform(0.0, max_delay_s))
        if zygote.kill(pid):
            stats.kills += 1
        last_ack: list[int | None] = [None] * n_convs
        manual_acked = []
        for parts in _read_acks(ack):
            stats.saves_acked += 1
            if parts[0] == "A":
                last_ack[int(parts[1])] = int(parts[2])
            else:
                manual_acked.append(parts[1])
        # Saves of one conversation are sequential: its file must hold the last save
        # acknowledged (or, without one this round, what it held before), or the save
        # that was in flight when the kill came.
        allowed = []
        for c in range(n_convs):
            previous = last_ack[c] if last_ack[c] is not None else on_disk[c]
            in_flight = last_ack[c] + 1 if last_ack[c] is not None else next_seq[c]
            allowed.append((previous, in_flight))
        found = _check_after_kill(store, convs, allowed, manual_acked, stats)
        for c in range(n_convs):
            on_disk[c] = found[c]
            next_seq[c] = max(next_seq[c], allowed[c][1], found[c] or 0) + 1
    if (work / "errors.log").exists():
        stats.problems.append("a writer failed: " + (work / "errors.log").read_text("utf-8")[-2000:])
    return stats


def _check_after_kill(store: Store, convs, allowed, manual_acked, stats: KillStats) -> list:
    names = set()
    for entry in store.entries():
        names.add(entry.path.name)
        if not entry.valid:
            stats.problems.append(f"listed file with a bad header: {entry.path.name}: {entry.error}")
            continue
        try:
            synthetic.load_fully(entry.path)
            stats.checkpoints_checked += 1
        except CheckpointError as exc:
            stats.problems.append(f"listed file fails validation: {entry.path.name}: {exc}")
    found = []
    for c, conv in enumerate(convs):
        previous, in_flight = allowed[c]
        path = synthetic.fixed_path(store, conv)
        try:
            seq = synthetic.load_fully(path).meta["seq"]
        except FileNotFoundError:
            seq = None
        except (OSError, CheckpointError) as exc:
            seq = f"damaged ({exc})"
        found.append(seq if isinstance(seq, int) else None)
        if seq is None and previous is None:
            continue   # never saved yet (or the first save was in flight)
        if seq not in (previous, in_flight):
            stats.lost += 1
            stats.problems.append(f"conversation {c}: file holds save {seq}; "
                                  f"previous {previous}, in flight {in_flight}")
    for name in manual_acked:
        if name not in names:
            stats.lost += 1
            stats.problems.append(f"acknowledged manual save {name} is missing")
        else:
            (store.folder / name).unlink(missing_ok=True)   # checked: keep the store small
    temps = store.temp_files()
    stats.temps_left += len(temps)
    removed = store.remove_stale_temps(min_age_s=0)   # the writer is dead: all are stale
    if removed != len(temps):
        stats.problems.append(f"{len(temps) - removed} temp files of a dead writer not removed")
    return found


@dataclass
class ConcurrencyStats:
    writers: int = 0
    saves: int = 0
    listings: int = 0
    validations: int = 0
    prunes: int = 0
    pruned: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def operations(self) -> int:
        return self.saves + self.validations + self.listings + self.prunes


def concurrency_campaign(folder: Path, *, n_writers: int, n_saves: int, zygote: Zygote,
                         prune_budget: int | None = 200_000, seed: int = 0) -> ConcurrencyStats:
    """``n_writers`` processes save ``n_saves`` times each into one store while a reader
    lists and validates continuously and (optionally) a pruner prunes."""
    rng = random.Random(seed)
    store = Store(folder)
    store.ensure()
    work = folder.parent / f"{folder.name}-work"
    work.mkdir(parents=True, exist_ok=True)
    stop = work / "stop"
    err = str(work / "errors.log")
    shared = uuid.UUID(int=rng.getrandbits(128))
    owns = [uuid.UUID(int=rng.getrandbits(128)) for _ in range(n_writers)]
    helpers = {"reader": zygote.spawn({"role": "reader", "folder": str(folder), "stop": str(stop),
                                       "result": str(work / "reader.json"), "error_log": err})}
    if prune_budget is not None:
        helpers["pruner"] = zygote.spawn({"role": "pruner", "folder": str(folder), "stop": str(stop),
                                          "budget": prune_budget, "result": str(work / "pruner.json"),
                                          "error_log": err})
    pids = [zygote.spawn({"role": "writer", "folder": str(folder), "writer": w, "own": owns[w].hex,
                          "shared": shared.hex, "n_saves": n_saves, "ack": str(work / f"w{w}.ack"),
                          "error_log": err}) for w in range(n_writers)]
    stats = ConcurrencyStats(writers=n_writers)
    for pid in pids:
        if zygote.reap(pid) != 0:
            stats.problems.append(f"writer {pid} exited abnormally")
    stop.touch()
    for name, pid in helpers.items():
        if zygote.reap(pid) != 0:
            stats.problems.append(f"{name} exited abnormally")
    if Path(err).exists():
        stats.problems.append("a worker raised: " + Path(err).read_text("utf-8")[-3000:])
        return stats
    reader = json.loads((work / "reader.json").read_text("utf-8"))
    stats.listings, stats.validations = reader["listings"], reader["validated"]
    stats.problems += reader["failures"]
    if prune_budget is not None:
        pruner = json.loads((work / "pruner.json").read_text("utf-8"))
        stats.prunes, stats.pruned = pruner["prunes"], pruner["deleted"]
    _check_after_concurrency(store, n_writers, owns, shared, work, stats)
    return stats


def _check_after_concurrency(store, n_writers, owns, shared, work, stats) -> None:
    last_shared = {}
    for w in range(n_writers):
        acks = _read_acks(work / f"w{w}.ack")
        stats.saves += len(acks)
        history = [parts for parts in acks if parts[0] == "H"]
        if history:   # the newest file of a line is its head: no prune may delete it
            try:
                synthetic.load_fully(store.folder / history[-1][1])
            except (OSError, CheckpointError) as exc:
                stats.problems.append(f"writer {w}: the head of its history line is gone: {exc}")
        for parts in acks:
            if parts[0] == "M":   # every manual save survives, unchanged: no overwrite
                name, seq = parts[1], int(parts[3])
                try:
                    meta = synthetic.load_fully(store.folder / name).meta
                except (OSError, CheckpointError) as exc:
                    stats.problems.append(f"manual save {name} lost or damaged: {exc}")
                    continue
                if (meta["writer"], meta["seq"]) != (w, seq):
                    stats.problems.append(f"manual save {name} was overwritten by {meta}")
            elif parts[0] == "S":
                last_shared[w] = int(parts[2])
        newest = acks[-1] if acks else None   # the writer's newest save of its own conversation
        if newest and newest[0] == "A":
            path = synthetic.fixed_path(store, owns[w])
        elif newest and newest[0] == "M":
            path = store.folder / newest[1]
        else:
            path = None
        if path is not None:
            try:
                synthetic.load_fully(path)
            except (OSError, CheckpointError) as exc:
                stats.problems.append(f"writer {w}: the newest checkpoint is gone: {exc}")
    try:
        meta = synthetic.load_fully(synthetic.fixed_path(store, shared)).meta
        if last_shared.get(meta["writer"]) != meta["seq"]:
            stats.problems.append(f"shared autosave holds {meta}, not a writer's last save")
    except (OSError, CheckpointError) as exc:
        if last_shared:
            stats.problems.append(f"shared autosave gone: {exc}")
