"""Random compositions of what users do to a store, and the invariants after them.

Used by tests/test_store_properties.py (hypothesis draws the sequences) and by
benchmarks/reliability.py (the composition row: many seeded sequences, counted).
A :class:`Driver` runs the app's engine thread (engine.worker) on a fresh store and
performs the actions; :func:`check` verifies the invariants after a clean exit and
returns what it found instead of stopping at the first problem.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from faultkit.zygote import ROOT

PROMPTS = ["Name three rivers.", "Write a line about snow.", "Count to five.", "Say something kind."]
#: action name -> the range of its integer argument
ACTIONS = {"answer": (4, 24), "pause": (2, 12), "resume": (4, 16), "regenerate": (4, 16),
           "edit": (4, 16), "switch": (0, 3), "prune": (0, 3), "delete": (0, 0), "reimport": (0, 0),
           "kill": (1, 3), "fork": (0, 3), "backup": (0, 0), "restore": (0, 0),
           "export": (0, 0)}
BUDGETS = [0, 1, 50_000, 10**9]


def random_actions(rng: random.Random, n: int) -> list[tuple[str, int, int]]:
    out = []
    for _ in range(n):
        kind = rng.choice(list(ACTIONS))
        lo, hi = ACTIONS[kind]
        arg = rng.randint(lo, hi)
        out.append((kind, rng.randint(0, 2), BUDGETS[arg] if kind == "prune" else arg))
    return out


class Driver:
    """The worker, a store, and the conversations the app has (up to three)."""

    def __init__(self, model: Path, home: Path, system: str = "", n_batch: int | None = None,
                 document: str = "") -> None:
        from engine.checkpoints.store import Store
        self.system = system   # the system prompt of slots 0 and 1 (a shared prefix when long)
        #: the start of every conversation's first message (a conversation on another's
        #: document builds on its file: a cut, engine.history.LineWriter._cut)
        self.document = document
        self.n_batch = n_batch   # the prefill chunk of the worker and of the CLI (None: theirs)
        from engine.worker import EngineWorker, ModelOptions, WorkerListener
        self.home = home
        self.store = Store(home / "data" / "checkpoints")
        driver = self
        self.pause_after: int | None = None
        self.texts = 0
        self.errors: list[tuple] = []
        self.unloadable: list[str] = []   # files announced as saved that did not load then

        class Listener(WorkerListener):
            def on_text(self, e):
                driver.texts += 1
                if driver.pause_after is not None and driver.texts >= driver.pause_after:
                    driver.pause_after = None
                    driver.worker.pause()   # on the engine thread: lands before the next token

            def on_error(self, e):
                driver.errors.append((e.action, e.message))

            def on_checkpoint_saved(self, e):
                # nothing is announced as saved unless it can be loaded, then and there
                from engine.checkpoints.chain import load_chain
                from engine.errors import AppError
                try:
                    load_chain(e.path)
                except (AppError, OSError) as exc:
                    driver.unloadable.append(f"{Path(e.path).name}: {exc}")

        self.worker = EngineWorker(Listener(), self.store)
        self.worker.autosave_every = 4
        self.worker.autosave_budget = 10**12
        self.worker.start()
        self.worker.load_model(ModelOptions(model, n_ctx=1024, n_threads=2, n_batch=n_batch))
        self.wait()
        self.kills = 0
        self.answered: set[uuid.UUID] = set()   # conversations with a message: they have files
        self.convs: list[uuid.UUID | None] = [None, None, None]
        self.deleted: set[uuid.UUID] = set()
        #: per slot, the last copy of its conversation's files taken out of the store
        #: (do_backup): the conversation, the folder, the head's name
        self.backups: dict[int, tuple[uuid.UUID, Path, str]] = {}
        self.import_problems: list[str] = []   # what do_restore found (check reports it)
        self.model = model

    def wait(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        time.sleep(0.01)
        while not self.worker.idle:
            assert time.monotonic() < deadline, "the engine thread did not finish"
            time.sleep(0.01)

    def conv(self, slot: int) -> uuid.UUID:
        from engine.sampling import SamplerSettings
        if self.convs[slot] is None:
            self.convs[slot] = self.worker.new_conversation(
                system_prompt=self.system if slot < 2 else "",
                sampler=SamplerSettings(seed=100 + slot, temperature=0.7 if slot else 0.0))
            self.wait()
        return self.convs[slot]

    def paused(self, conv_id) -> bool:
        c = self.worker.sessions.conversation(conv_id)   # read between commands only: the thread is idle
        return c is not None and c.paused

    def has_answer(self, conv_id) -> bool:
        c = self.worker.sessions.conversation(conv_id)
        return c is not None and c.answer is not None

    def run(self, kind: str, slot: int, n: int) -> None:
        getattr(self, f"do_{kind}")(slot, n)
        self.wait()

    def _message(self, c, text: str) -> str:
        conv = self.worker.sessions.conversation(c)
        first = conv is None or (not conv.messages and conv.answer is None)
        return self.document + text if first and self.document else text

    def do_answer(self, slot, n):
        c = self.conv(slot)
        self.answered.add(c)
        self.worker.send(c, self._message(c, PROMPTS[(slot + n) % len(PROMPTS)]), n_predict=n)

    def do_pause(self, slot, n):
        c = self.conv(slot)
        self.answered.add(c)
        self.texts, self.pause_after = 0, n
        self.worker.send(c, self._message(c, PROMPTS[(slot + n + 1) % len(PROMPTS)]), n_predict=200)
        self.wait()
        self.pause_after = None

    def _answered(self, slot, paused: bool = False) -> uuid.UUID:
        """The slot's conversation, given an answer first (a paused one if asked) when it
        has none, so that every action does real work."""
        c = self.conv(slot)
        if c not in self.answered or (paused and not self.paused(c)):
            (self.do_pause if paused else self.do_answer)(slot, 6)
            self.wait()
        return self.convs[slot]

    def do_resume(self, slot, n):
        c = self._answered(slot, paused=True)
        if self.paused(c):
            self.worker.resume(c, n_predict=self.worker.sessions.conversation(c).answer.n_generated + n)

    def do_regenerate(self, slot, n):
        c = self._answered(slot)
        if self.has_answer(c):
            self.worker.regenerate(c)

    def do_edit(self, slot, n):
        """Edit the conversation's first message: a new branch; the old turns stay."""
        c = self._answered(slot)
        conv = self.worker.sessions.conversation(c)
        if conv is not None and conv.messages and conv.messages[0][0] == "user":
            self.worker.edit_message(c, 0, PROMPTS[(slot + n + 2) % len(PROMPTS)], n)

    def do_switch(self, slot, pick):
        """Show another branch of the conversation (restoring only what differs)."""
        from engine.branches import branches_of
        c = self._answered(slot)
        session = self.worker.sessions.get(c)
        writer = session.writer if session is not None else None
        others = [b for b in branches_of(self.store, c)
                  if writer is None or writer.head is None or b.head != writer.head.path]
        if others:
            self.worker.switch_branch(c, others[pick % len(others)].head)

    def do_fork(self, slot, back):
        """Fork the conversation at its last message (``back`` 0) or an earlier one: a new
        conversation on its files, in a free slot (else the next one's: the conversation
        there is no longer acted on, its heads are still checked)."""
        c = self._answered(slot)
        conv = self.worker.sessions.conversation(c)
        n = len(conv.messages_with_answer()) if conv is not None else 0
        if n == 0:
            return
        fork = self.worker.fork(c, max(0, n - 1 - back))
        self.wait()
        target = next((i for i in range(3) if self.convs[i] is None), (slot + 1) % 3)
        self.convs[target] = fork
        session = self.worker.sessions.get(fork)
        if session is not None and session.head is not None:   # it wrote its file
            self.answered.add(fork)

    def do_prune(self, slot, budget):
        from engine.checkpoints import graph
        graph.prune(self.store, budget)

    def do_delete(self, slot, _n):
        c = self.convs[slot]
        if c is not None:
            self.answered.discard(c)
            self.worker.delete_conversation(c)
            self.deleted.add(c)
            self.convs[slot] = None

    def do_reimport(self, slot, _n):
        """Copy a conversation's head chain out, delete it, import the files, reopen it."""
        from engine.checkpoints import transfer
        from engine.checkpoints.graph import Graph
        c = self._answered(slot)
        heads = Graph.scan(self.store).heads_of(c) if c is not None else []
        if not heads:
            return
        g = Graph.scan(self.store)
        head = heads[0]
        out = Path(tempfile.mkdtemp(dir=self.home))
        chain = g.chain(head)
        for node in chain:
            shutil.copy2(node.path, out / node.name)
        self.worker.delete_conversation(c)
        self.wait()
        (alone,) = transfer.import_files([out / head.name], self.store)
        # a delta alone is refused, unless its parent is still in the store (a shared
        # system prompt, which a conversation's delete leaves): then it links up with it
        linkable = not head.is_delta or (self.store.folder / chain[-2].name).exists()
        assert alone.ok == linkable, alone.message()
        results = transfer.import_files(sorted(out.iterdir()), self.store)
        assert all(r.ok for r in results), [r.message() for r in results]
        self.worker.open_checkpoint(self.store.folder / head.name)

    def do_backup(self, slot, _n):
        """Copy a conversation's head chain out of the store, as a user backs files up."""
        from engine.checkpoints.graph import Graph
        c = self._answered(slot)
        g = Graph.scan(self.store)
        heads = g.heads_of(c)
        if not heads:
            return
        out = Path(tempfile.mkdtemp(dir=self.home))
        for node in g.chain(heads[0]):
            shutil.copy2(node.path, out / node.name)
        self.backups[slot] = (c, out, heads[0].name)

    def do_restore(self, slot, _n):
        """Import the slot's last backup, however old (its files may be in the store still,
        as heads, as older states, or kept for another conversation's sake; or gone), and
        resume it as the window offers: its conversation is the slot's again."""
        from engine.checkpoints import transfer
        from engine.checkpoints.graph import Graph, read_node
        if slot not in self.backups:
            return
        c, folder, head = self.backups[slot]
        results = transfer.import_files(sorted(folder.iterdir()), self.store)
        assert all(r.ok for r in results), [r.message() for r in results]
        (mine,) = [r for r in results if r.path.name == head]
        assert mine.imported is not None
        # an import brings back what it imports: a head of that state, before the app
        # opens it (the window asks "Resume now?", and the user may say Later)
        digest = read_node(folder / head).tokens_digest
        if not any(h.conversation_id == c and h.tokens_digest == digest for h in Graph.scan(self.store).heads):
            self.import_problems.append(f"{head}, imported ({mine.message()}), is no head")
        self.worker.open_checkpoint(mine.head or mine.imported)
        self.wait()
        self.convs[slot] = c
        self.answered.add(c)
        self.deleted.discard(c)

    def do_export(self, slot, _n):
        """Export a conversation's head (a chain is compacted into one file, its turn ends
        kept as points) and import that file again, as from another machine: a branch of
        its own, which restores and goes on like the head."""
        from engine.checkpoints import transfer
        from engine.checkpoints.graph import Graph
        c = self._answered(slot)
        heads = Graph.scan(self.store).heads_of(c)
        if not heads:
            return
        out = Path(tempfile.mkdtemp(dir=self.home)) / "exported.kvckpt"
        self.worker.export(heads[0].path, out)
        self.wait()
        if not out.exists():
            return   # the engine said why (an error, which check reports)
        (result,) = transfer.import_files([out], self.store)
        assert result.ok, result.message()

    def do_kill(self, slot, n_autosaves):
        """The CLI continues the conversation's head in a child, killed mid-answer."""
        from engine.checkpoints.graph import Graph
        c = self._answered(slot)
        heads = Graph.scan(self.store).heads_of(c)
        if not heads:
            return
        head = heads[0]
        args = [sys.executable, "-m", "engine.cli", "run", "--checkpoint-load", str(head.path),
                "-n", "400", "--ignore-eos", "--checkpoint-save-interval", "4", "--threads", "1"]
        if not self.paused(c):
            args += ["-p", "Go on."]
        if self.n_batch:
            args += ["-b", str(self.n_batch)]
        before = {p.name for p in self.store.files()}
        env = dict(os.environ, CHECKPOINT_CHAT_HOME=str(self.home))
        proc = subprocess.Popen(args, cwd=str(ROOT), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while len({p.name for p in self.store.files()} - before) < n_autosaves:
            if proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        self.kills += 1

    def close(self) -> None:
        self.worker.shutdown()
        assert self.worker.join(300)


@dataclass
class Outcome:
    heads_checked: int = 0
    heads_lost: list[str] = field(default_factory=list)   # a head that does not restore exactly
    orphans: list[str] = field(default_factory=list)      # files no head needs, after a clean exit
    problems: list[str] = field(default_factory=list)     # anything else


def check(driver: Driver, runtime) -> Outcome:
    """The invariants after a clean exit (see tests/test_store_properties.py).

    A head's continuation is compared with the same tokens decoded from scratch in
    ``runtime``: an exact reference only where its decodes give the bits the app's did
    whatever their batch boundaries (SmolLM2; Gemma 3 with batches of at most 3 tokens:
    ``run_sequence``'s ``n_batch``).
    """
    from engine.checkpoints.chain import load_chain
    from engine.checkpoints.graph import Graph
    from engine.errors import AppError
    from engine.generation import begin_answer, generate

    out = Outcome()
    g = Graph.scan(driver.store)
    out.problems += [f"unreadable: {u.path.name}: {u.error}" for u in g.unreadable]
    out.orphans = [n.name for n in g.nodes.values() if not g.reachable(n)]
    live = {c for c in driver.convs if c is not None and c in driver.answered}
    have = {h.conversation_id for h in g.heads}
    if not live <= have:
        out.problems.append("a conversation the app has lost its head")
    if (driver.deleted - live) & have:
        out.problems.append("a deleted conversation came back")
    out.problems += [f"engine error: {a}: {m}" for a, m in driver.errors]
    out.problems += [f"announced as saved, not loadable: {u}" for u in driver.unloadable]
    out.problems += driver.import_problems
    # the app's newest state of each conversation is in the store, restorable: a head, or
    # a file some head builds on (a CLI run may have continued it on a branch of its own)
    from engine.checkpoints.chain import tokens_digest
    for c in live:
        conv = driver.worker.sessions.conversation(c)   # the engine thread has stopped: safe to read
        if conv is None:
            continue
        if not any(n.conversation_id == c and g.reachable(n) and g.chain_problem(n) is None
                   and n.header.n_tokens_total == len(conv.tokens)
                   and n.tokens_digest == tokens_digest(conv.tokens[:n.header.n_tokens])
                   for n in g.nodes.values()):
            out.heads_lost.append(f"conversation {c}: its newest state ({len(conv.tokens)} tokens) has no head")
    for head in g.heads:
        out.heads_checked += 1
        texts, after = [], []
        try:
            for restored in (True, False):
                runtime.trim(0)   # every file of the chain applied, none taken from the cache
                conv = runtime.restore_chain(load_chain(head.path))
                n_before = len(conv.tokens)   # what follows is what the check read and sampled
                if not restored:
                    runtime.trim(0)             # the same tokens, decoded from scratch
                conv.sampler = replace(conv.sampler, ignore_eos=True)
                paused = conv.paused
                if paused:
                    conv.answer.n_predict = -1
                elif len(conv.tokens) + ROOM_TO_ASK > runtime.ctx.n_ctx:
                    break   # no room for a next message (the window offers a branch): see below
                else:
                    begin_answer(conv, runtime, "And then?", n_predict=-1)
                result = generate(runtime, conv, stop_after=5)
                # an autosave head (a killed run's) carries no logits: its last token,
                # a generated one, is decoded again (engine.runtime.logits_rule); one that
                # a prefill wrote at a mark of its prompt (engine.generation.mark_wants_file)
                # holds only that far: the rest of the prompt is read, none of what it holds
                redecoded = 0 if head.header.has_logits else 1
                held = min(head.header.n_tokens, result.n_prompt_tokens)
                if restored and paused and result.n_reused_tokens < held - redecoded:
                    out.problems.append(f"{head.name}: the restore re-decoded the prompt")
                texts.append(result.text)
                after = after or list(conv.tokens[n_before:])
        except AppError as exc:
            out.heads_lost.append(f"{head.name}: {exc}")
            continue
        tolerance = FORCED_TOLERANCE if runtime.shape.has_recurrent else 0.0
        if len(texts) < 2:   # no room to go on: its logits there, at least
            if _forced_drift(runtime, head.path, []) > tolerance:
                out.heads_lost.append(f"{head.name}: its logits are not a recompute's")
        elif texts[0] != texts[1] and (not tolerance or _forced_drift(runtime, head.path, after) > tolerance):
            out.heads_lost.append(f"{head.name}: continues otherwise than a recompute")
    return out


#: the tokens a head's check asks with ("And then?" in a chat template) need this much room
ROOM_TO_ASK = 32
#: how far a recurrent or hybrid memory's teacher-forced logits may drift between a
#: restore and a recompute (relative to the largest logit, or 1): their states come from
#: decodes of other shapes (a prompt in one batch, an answer token by token), whose bits
#: differ.  Measured on the tiny models (random weights, logits below 1): up to 0.002 after
#: a few tokens; a state one token off moves them by 0.7 to 1.1
FORCED_TOLERANCE = 0.05


def _forced_drift(runtime, head: Path, tokens) -> float:
    """Restore ``head``, and decode its tokens again from scratch; feed both ``tokens``
    (what the restored answer read and sampled after it) one at a time: the largest
    difference of their logits along the way, relative to the largest logit (or 1).

    A sampled continuation is an exact reference only where every decode gives the bits
    the app's did whatever its batch boundaries (plain attention here, see check); a
    recurrent scan does not, so a random tiny model's near-flat logits can sample another
    token a few steps on from a restore that is right.  What a wrong restore gets wrong (a
    snapshot a token off, another conversation's cells) moves the logits by far more."""
    import numpy as np

    from engine.checkpoints.chain import load_chain
    rows = []
    for restored in (True, False):
        runtime.trim(0)   # every file applied (a restore skips those the cache holds)
        held = list(runtime.restore_chain(load_chain(head)).tokens)
        if not restored:
            runtime.trim(0)
        # a file without logits has its last token decoded again (attention) or its pending
        # one decoded (a recurrent memory's autosave, one token short), as a resume does
        runtime.prefill(held)
        steps = [np.array(runtime.logits(), dtype=np.float64)]
        for token in tokens:
            runtime.decode_token(token)
            steps.append(np.array(runtime.logits(), dtype=np.float64))
        rows.append(np.stack(steps))
    return float(np.abs(rows[0] - rows[1]).max() / max(1.0, np.abs(rows[1]).max()))


def run_sequence(model: Path, home: Path, actions, runtime, system: str = "",
                 n_batch: int | None = None, document: str = "") -> tuple[Driver, Outcome]:
    """Perform ``actions`` on a fresh store in ``home``, exit cleanly, and check the
    invariants with ``runtime`` (a context shaped like the worker's).  ``n_batch``: the
    prefill chunk of the worker and of the killed CLI runs; the checking runtime must use
    the same (see check: its recompute is the reference)."""
    driver = Driver(model, home, system, n_batch, document)
    try:
        for kind, slot, n in actions:
            driver.run(kind, slot, n)
    finally:
        driver.close()
    return driver, check(driver, runtime)
