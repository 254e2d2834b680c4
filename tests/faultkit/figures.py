"""The campaigns behind benchmarks/reliability.py, each returning one row of its table.

Every row counts what was broken and what broke: ``lost`` is a checkpoint (or a
conversation's last version) that did not survive, ``crashes`` is any outcome other than
a clean refusal or a clean success (an unexpected exception, a damaged file accepted, a
temp file left behind).  ``problems`` says what, in words.
"""

from __future__ import annotations

import errno
import io
import os
import random
import struct
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from engine.checkpoints import atomic
from engine.checkpoints import format as fmt
from engine.errors import CheckpointError
from faultkit import corrupt, synthetic
from faultkit.campaigns import concurrency_campaign, kill_campaign
from faultkit.zygote import ROOT, Zygote


@dataclass
class Row:
    case: str
    runs: int = 0
    kills: int = 0
    corrupt: int = 0
    concurrent: int = 0
    lost: int = 0
    crashes: int = 0
    problems: list[str] = field(default_factory=list)


def killed_writer(work: Path, n_kills: int, zygote: Zygote) -> Row:
    s = kill_campaign(work / "检查点 kills", n_kills, seed=11, zygote=zygote)
    return Row("1 killed writer (synthetic state)", runs=s.saves_acked, kills=s.kills,
               lost=s.lost, crashes=len(s.problems) - s.lost, problems=s.problems)


def killed_model_writer(work: Path, n_kills: int, zygote: Zygote) -> Row:
    """SIGKILL a process saving SmolLM2's real state; the survivor must verify."""
    import time

    from engine.checkpoints.store import Store
    from engine.models import default_model_path
    row = Row("1 killed writer (SmolLM2 state)")
    folder, conv, rng, seq = work / "model kills", uuid.uuid4(), random.Random(3), 1
    for k in range(n_kills):
        ack = work / f"model-{k}.ack"
        pid = zygote.spawn({"role": "model-writer", "folder": str(folder), "n_ctx": 512,
                            "model": str(default_model_path()), "conv": conv.hex, "next_seq": seq,
                            "prompt": "Name three colours.", "ack": str(ack),
                            "error_log": str(work / "model-errors.log")})
        deadline = time.monotonic() + 60
        while not (ack.exists() and ack.read_text().startswith("READY")) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.06))
        row.kills += zygote.kill(pid)
        acked = len(ack.read_text().splitlines()) - 1 if ack.exists() else 0
        row.runs += max(acked, 0)
        seq += acked + 2
        store = Store(folder)
        store.remove_stale_temps(min_age_s=0)
        if acked or store.files():
            try:
                fmt.verify_file(synthetic.fixed_path(store, conv))
            except (OSError, CheckpointError) as exc:
                row.lost += 1
                row.problems.append(f"model kill {k}: autosave lost: {exc}")
    if (work / "model-errors.log").exists():
        row.crashes += 1
        row.problems.append((work / "model-errors.log").read_text()[-2000:])
    return row


def _judge(row: Row, data: bytes, path: Path, must_refuse: bool = True) -> None:
    row.corrupt += 1
    try:
        refused = corrupt.verdict(data, path) is not None
    except Exception as exc:   # noqa: BLE001 - anything but a refusal is a crash
        row.crashes += 1
        row.problems.append(f"{type(exc).__name__}: {exc}")
        return
    if must_refuse and not refused:
        row.crashes += 1
        row.problems.append("a damaged file was accepted")


def truncation_and_flips(work: Path, n_flips: int) -> Row:
    row = Row("2 truncation and bit flips")
    rng = random.Random(2)
    path = work / "damaged.kvckpt"
    base, big = synthetic.file_bytes(8), synthetic.file_bytes(300, seq=3)
    for cut in range(fmt.HEADER_LEN + 1):
        _judge(row, base[:cut], path)
    for cut in rng.sample(range(fmt.HEADER_LEN, len(big)), min(2000, len(big) - fmt.HEADER_LEN)):
        _judge(row, big[:cut], path)
    for _ in range(n_flips):
        _judge(row, corrupt.flip(base, rng.sample(range(8 * len(base)), rng.randint(1, 3))), path)
    row.runs = row.corrupt
    return row


def hostile_headers(work: Path) -> Row:
    row = Row("3 hostile headers and metadata")
    path = work / "hostile.kvckpt"
    base = synthetic.file_bytes(8)
    u32, u64 = 2**32 - 1, 2**64 - 1
    variants = [dict(n_tokens=u32), dict(n_tokens_total=u32, tokens_len=4 * u32),
                dict(meta_len=u64), dict(state_len=2**63), dict(state_len=3 << 20),
                dict(header_len=2**31), dict(magic=b"NOTACKPT"), dict(version=2),
                dict(meta_len=2**24, state_len=u64 - 2**24), dict(flags=0xFFFF),
                dict(n_layer=u32), dict(n_vocab=0), dict(kind=255)]
    for changes in variants:
        with corrupt.peak_memory() as peak:
            _judge(row, corrupt.with_header(base, **changes), path)
        if peak[0] > 1 << 20:
            row.crashes += 1
            row.problems.append(f"{changes}: {peak[0]} bytes allocated to refuse")
    f = corrupt.header_fields(base)
    for meta in (b'{"a":[' + b"[]," * 500_000 + b"[]]}", b"[" * 50_000 + b"]" * 50_000,
                 b'{"a":' + b"9" * 9000 + b"}"):
        rest = base[fmt.HEADER_LEN + f["meta_len"]:]
        data = corrupt.with_payload_crc(corrupt.with_header(base[:fmt.HEADER_LEN], meta_len=len(meta))
                                        + meta + rest)
        with corrupt.peak_memory() as peak:
            _judge(row, data, path)
        if peak[0] > 4 * len(meta) + (1 << 20):
            row.crashes += 1
            row.problems.append(f"{peak[0]} bytes allocated to refuse {len(meta)} bytes of JSON")
    row.runs = row.corrupt
    return row


def foreign_and_mismatched() -> Row:
    """Case 4 needs two real models and several contexts: run its pytest module."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_reliability_models.py"], cwd=str(ROOT),
                          capture_output=True, text=True)
    last = (done.stdout.strip().splitlines() or [""])[-1]
    passed = int(last.split(" passed")[0].split()[-1]) if " passed" in last else 0
    row = Row("4 foreign model / other context", runs=passed, corrupt=passed)
    if done.returncode != 0:
        row.crashes += 1
        row.problems.append(done.stdout[-3000:])
    return row


class _FailingRaw(io.RawIOBase):
    def __init__(self, real, err, after):
        self._real, self._err, self._after, self.written, self.name = real, err, after, 0, real.name

    def writable(self):
        return True

    def write(self, data):
        n = len(memoryview(data).cast("B"))
        if self.written + n > self._after:
            raise OSError(self._err, os.strerror(self._err))
        self.written += n
        return self._real.write(data)

    def fileno(self):
        return self._real.fileno()

    def close(self):
        self._real.close()
        super().close()


def disk_trouble(work: Path, n_runs: int) -> Row:
    row = Row("5 ENOSPC / EIO in write and fsync")
    folder = work / "磁盘 💾"
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(5)
    real_open, real_fsync = atomic.open_file, atomic.fsync
    conv = uuid.uuid4()
    target = folder / "disk.kvckpt"
    synthetic.write(target, conv, 0, n_tokens=64)
    for i in range(n_runs):
        before = target.read_bytes()
        err = rng.choice([errno.ENOSPC, errno.EIO])
        if i % 4 == 3:
            def failing_fsync(fd, err=err):
                raise OSError(err, os.strerror(err))
            atomic.fsync = failing_fsync
        else:
            after = rng.randrange(0, 40_000)
            atomic.open_file = lambda p, m, err=err, after=after: io.BufferedWriter(
                _FailingRaw(io.FileIO(p, m.replace("b", "")), err, after))
        try:
            synthetic.write(target, conv, i + 1, n_tokens=80)
            row.crashes += 1
            row.problems.append("an injected failure went unnoticed")
        except OSError as exc:
            if exc.errno != err:
                row.crashes += 1
                row.problems.append(f"the error was replaced by {exc!r}")
        finally:
            atomic.open_file, atomic.fsync = real_open, real_fsync
        row.runs += 1
        if target.read_bytes() != before:
            row.lost += 1
            row.problems.append("the previous file changed after a failed save")
        if any(atomic.is_temp_name(p.name) for p in folder.iterdir()):
            row.crashes += 1
            row.problems.append("a temp file was left behind")
    return row


class _WinError(PermissionError):
    def __init__(self, winerror):
        super().__init__(errno.EACCES, "sharing violation")
        self.winerror = winerror


def _failing_replace(real_replace, failures: int, winerror: int):
    """An ``os.replace`` whose first ``failures`` calls raise ``winerror``, then succeed."""
    attempts = []

    def replace(src, dst):
        attempts.append(1)
        if len(attempts) <= failures:
            raise _WinError(winerror)
        real_replace(src, dst)
    return replace


def windows_replace(work: Path, n_runs: int) -> Row:
    row = Row("6 os.replace winerror 5/32/33, non-ASCII")
    folder = work / "用户" / "文档" / "🧠"
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(6)
    real_replace, real_budget = atomic.replace, atomic.REPLACE_RETRY_S
    conv = uuid.uuid4()
    target = folder / "检查点.kvckpt"
    synthetic.write(target, conv, 0, n_tokens=16, durable=False)
    try:
        for i in range(n_runs):
            permanent = i % 10 == 9
            failures = 10**9 if permanent else rng.randint(1, 5)
            replace = _failing_replace(real_replace, failures, rng.choice([5, 32, 33]))
            # up to 5 failures fit in 1 s of back-off; a permanent one gives up after 0.1 s
            atomic.replace, atomic.REPLACE_RETRY_S = replace, 0.1 if permanent else 1.0
            before = target.read_bytes()
            try:
                synthetic.write(target, conv, i + 1, n_tokens=16, durable=False)
                ok = not permanent and synthetic.load_fully(target).meta["seq"] == i + 1
            except PermissionError:
                ok = permanent and target.read_bytes() == before
            row.runs += 1
            if not ok:
                row.crashes += 1
                row.problems.append(f"run {i}: wrong outcome (permanent={permanent})")
    finally:
        atomic.replace, atomic.REPLACE_RETRY_S = real_replace, real_budget
    return row


def concurrency(work: Path, n_writers: int, n_saves: int, zygote: Zygote) -> Row:
    s = concurrency_campaign(work / "共享 concurrency", n_writers=n_writers, n_saves=n_saves,
                             zygote=zygote, seed=7)
    return Row(f"7 {n_writers} writers + reader + pruner", runs=s.saves, concurrent=s.operations,
               crashes=len(s.problems), problems=s.problems)


def fuzz(work: Path, n_cases: int) -> Row:
    """Random header fields resealed with a valid CRC, random cuts, random bytes."""
    row = Row("9 parser fuzz (resealed headers, random bytes)")
    rng = random.Random(9)
    base = synthetic.file_bytes(8)
    path = work / "fuzz.kvckpt"
    names = [n for n in corrupt.FIELDS if n != "crc"]
    sizes = {"B": 8, "H": 16, "I": 32, "i": 32, "Q": 64, "q": 64}
    fields = corrupt.header_fields(base)
    for i in range(n_cases):
        if i % 5 == 4:
            blob = fmt.MAGIC + struct.pack("<H", 1) + rng.randbytes(rng.randrange(600))
            _judge(row, blob, path)
            continue
        changes = {}
        for name in rng.sample(names, rng.randint(1, 4)):
            code = corrupt.FIELD_CODES[name]
            if code == "s":
                changes[name] = rng.randbytes(len(fields[name]))
            else:
                bits = sizes[code]
                value = rng.choice([0, 1, 2**bits - 1, rng.getrandbits(bits)])
                changes[name] = value - 2 ** (bits - 1) if code in "iq" and value >= 2 ** (bits - 1) else value
        data = corrupt.with_header(base, **changes)
        if rng.random() < 0.3:
            data = data[:rng.randrange(len(data) + 1)]
        _judge(row, data, path, must_refuse=False)
    row.runs = row.corrupt
    return row


@dataclass
class CompositionRow:
    case: str
    sequences: int = 0
    actions: int = 0
    kills: int = 0
    heads_checked: int = 0
    heads_lost: int = 0
    orphans: int = 0
    problems: list[str] = field(default_factory=list)


def composition(work: Path, n_sequences: int, seed: int = 5) -> CompositionRow:
    """Random user action sequences on the store, with kills and budgets (real SmolLM2)."""
    from engine.models import default_model_path
    from engine.runtime import Runtime
    from faultkit.compositions import random_actions, run_sequence
    from native.context import ContextSettings
    row = CompositionRow("10 compositions: answer/pause/resume/regenerate/switch/prune/delete/"
                         "import/kill -9")
    rng = random.Random(seed)
    model = default_model_path()
    checker = Runtime(model, ContextSettings(n_ctx=1024, n_threads=2))
    try:
        for i in range(n_sequences):
            actions = random_actions(rng, rng.randint(4, 10))
            driver, outcome = run_sequence(model, work / f"composition-{i}", actions, checker)
            row.sequences += 1
            row.actions += len(actions)
            row.kills += driver.kills
            row.heads_checked += outcome.heads_checked
            row.heads_lost += len(outcome.heads_lost)
            row.orphans += len(outcome.orphans)
            row.problems += [f"sequence {i} {actions}: {p}"
                             for p in outcome.heads_lost + outcome.orphans + outcome.problems]
    finally:
        checker.close()
    return row
