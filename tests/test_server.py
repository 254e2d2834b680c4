"""The local server against the official `openai` client: `checkpoint-chat serve` in a child
process on 127.0.0.1 and a free port, with the real SmolLM2 (context 1024, two threads,
short answers).

What users live: a conversation of five turns whose every turn is restored, not
recomputed, across a restart of the server; the same seed giving the text `run` gives,
streamed or not; a client that goes away leaving a paused, valid checkpoint; and every
kind of bad request answered with OpenAI's error body, never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from itertools import pairwise
from pathlib import Path

import pytest
from conftest import ROOT, run_cli

from benchmarks.server import ServeProcess

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")

KEY = "test-key-123"


class Served(ServeProcess):
    """`checkpoint-chat serve --port 0 -c 1024 -t 2 ...`, and an openai client for it."""

    def __init__(self, home: Path, *extra: str) -> None:
        super().__init__(home, "-c", "1024", "-t", "2", *extra)

    def client(self, key: str = KEY):
        return openai.OpenAI(base_url=self.base_url, api_key=key, max_retries=0, timeout=300)


@pytest.fixture
def served():
    started: list[Served] = []

    def start(home: Path, *extra: str) -> Served:
        server = Served(home, *extra)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def raw(server: Served, method: str, path: str, body: bytes | None = None, key: str | None = KEY):
    """(status, JSON body) of a request made without the client (bodies it would never send)."""
    request = urllib.request.Request(server.base_url.removesuffix("/v1") + path, data=body, method=method)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def heads():
    from engine.checkpoints.graph import Graph
    from engine.checkpoints.store import Store
    return Graph.scan(Store()).heads


def ask(client, model: str, messages: list[dict], *, stream: bool, **kwargs) -> tuple[str, object, dict]:
    """One turn: (text, usage, checkpoint_chat extension), streamed or not."""
    if not stream:
        r = client.chat.completions.create(model=model, messages=messages, **kwargs)
        return r.choices[0].message.content, r.usage, r.model_extra["checkpoint_chat"]
    text, usage, ext = [], None, None
    for chunk in client.chat.completions.create(model=model, messages=messages, stream=True,
                                                stream_options={"include_usage": True}, **kwargs):
        assert chunk.object == "chat.completion.chunk"
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            if chunk.choices[0].finish_reason:
                ext = chunk.model_extra["checkpoint_chat"]
        if chunk.usage is not None:
            usage = chunk.usage
    return "".join(text), usage, ext


def test_five_turns_each_restores_every_turn_before_it_across_a_restart(app_home, served):
    server = served(app_home)
    client = server.client()
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": "You answer in one short sentence."}]
    questions = ["What is the capital of France?", "And of Italy?", "Which one is bigger?",
                 "Name a river in one of them.", "Thank you. Say goodbye."]
    usages, conversations = [], set()
    for k, question in enumerate(questions, 1):
        if k == 4:   # a new process: nothing of the conversation is in memory any more
            assert server.stop() == 0
            server = served(app_home)
            client = server.client()
        messages.append({"role": "user", "content": question})
        text, usage, ext = ask(client, model, messages, stream=k % 2 == 0, max_tokens=24, seed=k)
        assert text and usage.completion_tokens > 0
        messages.append({"role": "assistant", "content": text})
        usages.append(usage)
        conversations.add(ext["conversation"])
        # every answer is a head in the store (saved before the response was sent)
        assert Path(ext["checkpoint"]).name in {h.path.name for h in heads()}
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    for before, usage in pairwise(usages):
        # turn k restores exactly all of turn k-1: its prompt and its answer
        assert usage.prompt_tokens_details.cached_tokens == before.prompt_tokens + before.completion_tokens
    assert len(conversations) == 1
    assert server.stop() == 0


def test_requests_on_one_document_store_it_once(app_home, served):
    """Requests that start with the same document (no system prompt) and ask different
    questions: each later one is started from the first's file and stores only its own
    tokens (a cut delta, engine.history.LineWriter._cut)."""
    from engine.checkpoints.store import Store
    document = "Log: " + " ".join(f"crate {i} went to bay {i % 5};" for i in range(40))
    server = served(app_home)
    client = server.client()
    model = client.models.list().data[0].id
    sizes, usages = [], []
    for question in ("Which bay did crate 7 go to?", "How many crates went to bay 2?", "Summarise the log."):
        messages = [{"role": "user", "content": f"{document}\n\n{question}"}]
        text, usage, _ = ask(client, model, messages, stream=False, max_tokens=8, seed=1)
        assert text
        usages.append(usage)
        sizes.append(sum(p.stat().st_size for p in Store().files()))
    assert server.stop() == 0
    assert all(u.prompt_tokens_details.cached_tokens > 300 for u in usages[1:])
    assert sizes[2] - sizes[0] < sizes[0] / 5, sizes
    assert len(heads()) == 3


def test_the_same_seed_gives_the_text_run_gives_streamed_or_not(app_home, served):
    prompt = "Write one sentence about the sea."
    done = run_cli("run", "-p", prompt, "-s", "7", "-n", "24", "-c", "1024", "-t", "2", "--temp", "0.9",
                   "--top-p", "0.8", "--json", check=True)
    expected = json.loads(done.stdout)["text"]
    server = served(app_home)
    client = server.client()
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": prompt}]
    for stream in (False, True):
        text, usage, _ = ask(client, model, messages, stream=stream, max_tokens=24, seed=7, temperature=0.9,
                             top_p=0.8)
        assert text == expected
        assert usage.completion_tokens == 24 or len(text) < 200
    # a plain completion (no chat template): the same text streamed or not
    whole = client.completions.create(model=model, prompt="The sea is", max_tokens=12, seed=3)
    parts = [c.choices[0].text for c in client.completions.create(model=model, prompt="The sea is", max_tokens=12,
                                                                  seed=3, stream=True) if c.choices]
    assert whole.object == "text_completion" and whole.choices[0].text == "".join(parts)
    assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens > 0
    assert server.stop() == 0


def test_a_client_that_goes_away_pauses_its_answer_and_leaves_a_valid_checkpoint(app_home, served):
    from engine.checkpoints.chain import load_chain
    from engine.checkpoints.format import KIND_PAUSE
    server = served(app_home)
    client = server.client()
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, stream=True, max_tokens=400,
                                            messages=[{"role": "user", "content": "Count from one to a hundred."}],
                                            extra_body={"ignore_eos": True})
    pieces = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if len(pieces) >= 3:
            break
    stream.close()
    deadline = time.monotonic() + 60
    paused = []
    while not paused and time.monotonic() < deadline:
        paused = [h for h in heads() if h.header.kind == KIND_PAUSE]
        time.sleep(0.2)
    assert paused, server.stderr()
    chain = load_chain(paused[0].path)          # every file of its chain verifies in full
    answer = chain[-1].meta["conversation"]["answer"]
    assert answer["finish_reason"] is None and 3 <= answer["n_generated"] < 400
    assert answer["text"].startswith("".join(pieces))
    # the server goes on serving
    text, _, _ = ask(client, model, [{"role": "user", "content": "Hi"}], stream=False, max_tokens=4, seed=1)
    assert text
    assert server.stop() == 0
    assert "Traceback" not in server.stderr()


def test_an_answer_cut_short_by_the_server_stopping_says_it_was_paused(served, app_home):
    """SIGINT/SIGTERM mid-answer pauses and saves it; the client got finish_reason "length"
    with fewer tokens than ``max_tokens`` and could not tell it from the limit (a user's
    test, streamed and not): ``checkpoint_chat.paused`` says so; an answer that ends by
    itself says false."""
    import threading
    server = served(app_home)
    assert "requests are answered up to 4 at once" in server.stderr()   # (it said one at a time)
    client = server.client()
    model = client.models.list().data[0].id
    done = client.chat.completions.create(model=model, max_tokens=4, seed=1,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert done.model_extra["checkpoint_chat"]["paused"] is False
    chunks: list = []
    streaming = threading.Event()

    def ask_long() -> None:
        for chunk in client.chat.completions.create(model=model, max_tokens=1000, stream=True,
                                                    extra_body={"ignore_eos": True},
                                                    messages=[{"role": "user", "content": "Count to a thousand."}]):
            chunks.append(chunk)
            streaming.set()

    asking = threading.Thread(target=ask_long)
    asking.start()
    assert streaming.wait(60)          # the answer is under way
    assert server.stop() == 0
    asking.join(60)
    last = chunks[-1]
    assert last.choices[0].finish_reason == "length" and len(chunks) < 1000
    assert last.model_extra["checkpoint_chat"]["paused"] is True
    assert last.model_extra["checkpoint_chat"]["checkpoint"]


def test_bad_requests_get_openai_errors_and_the_server_goes_on(app_home, served):
    server = served(app_home, "--api-key", KEY, "--max-request-kb", "64")
    client = server.client()
    model = client.models.list().data[0].id
    hi = [{"role": "user", "content": "Hi"}]

    with pytest.raises(openai.AuthenticationError) as info:
        server.client("wrong-key").models.list()
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    status, body = raw(server, "POST", "/v1/chat/completions", b"{}", key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert raw(server, "GET", "/health", key=None) == (200, {"status": "ok", "model": model})

    status, body = raw(server, "POST", "/v1/chat/completions", b'{"model": "x", "messages": [')
    assert status == 400 and "JSON" in body["error"]["message"]
    status, body = raw(server, "POST", "/v1/chat/completions",
                       json.dumps({"model": model, "messages": "hi"}).encode())
    assert status == 400 and body["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=hi, max_tokens="ten")
    assert info.value.param == "max_tokens" and info.value.code == "invalid_type"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=hi, temperature=True)
    assert info.value.param == "temperature"

    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=hi)
    assert info.value.code == "model_not_found"

    status, body = raw(server, "POST", "/v1/chat/completions", b"x" * (100 << 10))
    assert status == 413 and body["error"]["code"] == "request_too_large"

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "word " * 1500}])
    assert info.value.code == "context_length_exceeded" and "1024" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:   # fits, but not with the answer asked for
        client.chat.completions.create(model=model, messages=hi, max_tokens=1020)
    assert info.value.code == "context_length_exceeded" and "in the completion" in info.value.message

    status, body = raw(server, "GET", "/v1/nowhere")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}

    text, usage, _ = ask(client, model, hi, stream=True, max_tokens=4, seed=1)   # still serving
    assert text and usage.completion_tokens > 0
    assert server.stop() == 0
    assert "Traceback" not in server.stderr()


def test_only_loopback_goes_without_an_api_key(app_home, served):
    done = run_cli("serve", "--host", "0.0.0.0", "--port", "0")
    assert done.returncode == 1 and done.stderr.startswith("error: ") and "--api-key" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    missing = run_cli("serve", "--port", "0", "-m", str(app_home / "missing.gguf"))
    assert missing.returncode == 1 and missing.stderr.strip().splitlines() == [
        f"error: model file not found: {app_home / 'missing.gguf'}"]
    server = served(app_home, "--host", "0.0.0.0", "--api-key", KEY)
    assert "warning: listening on 0.0.0.0" in server.stderr()
    port = server.base_url.rsplit(":", 1)[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}", api_key=KEY, max_retries=0)
    assert client.models.list().data
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}", api_key="wrong", max_retries=0).models.list()
    assert server.stop() == 0


@contextlib.contextmanager
def _requests_worker(smollm_path: Path, tmp_path: Path, *, n_ctx: int, kept: int | None = None):
    """The engine thread alone (no HTTP), SmolLM2 loaded: ``(worker, recorder)`` of its
    requests' events ("done", "refused", "progress" besides enginekit.Recorder's), shut
    down after.  ``kept``: its request_conversations_kept."""
    from enginekit import Recorder

    from engine.checkpoints.store import Store
    from engine.worker import EngineWorker, ModelOptions

    class Requests(Recorder):
        fail_text = False   # the next text event raises, as a buggy front end would

        def on_text(self, e):
            super().on_text(e)
            if self.fail_text:
                self.fail_text = False
                raise RuntimeError("a bug in a front end")

        def on_request_finished(self, e):
            self._add("done", e.request_id, e.conv_id, e.checkpoint)

        def on_request_failed(self, e):
            self._add("refused", e.request_id, e.refusal)

        def on_prefill_progress(self, e):
            self._add("progress", e.done)

    rec = Requests()
    w = EngineWorker(rec, Store(tmp_path / "store"))
    if kept is not None:
        w.request_conversations_kept = kept
    w.start()
    try:
        w.load_model(ModelOptions(smollm_path, n_ctx=n_ctx, n_threads=2))
        rec.wait("loaded")
        yield w, rec
    finally:
        w.shutdown()
        assert w.join(60)


def test_a_bounded_server_lets_old_conversations_go_and_restores_them_from_the_store(smollm_path, tmp_path):
    """The engine command alone (no HTTP): with one conversation kept open besides the one
    in the cache, a third conversation closes the first (its line's lease too), and a
    request continuing the first restores it from its head on disk."""
    from engine.requests import CompletionRequest

    with _requests_worker(smollm_path, tmp_path, n_ctx=1024, kept=1) as (w, rec):
        def complete(messages) -> tuple:
            w.complete(CompletionRequest(request_id=f"r{len(rec.of('done'))}", messages=tuple(messages),
                                         n_predict=6, seed=1))
            done = rec.next("done")
            return done[2], rec.of("finished")[-1][1]

        first = [("user", "Name a color.")]
        conv_a, answer_a = complete(first)
        for question in ("Name a tree.", "Name a bird."):
            complete([("user", question)])
        assert conv_a not in w.sessions and sum(1 for s in w.sessions if s.writer is not None) <= 2
        conv, again = complete(first + [("assistant", answer_a.text), ("user", "Another one.")])
        assert conv == conv_a and again.n_reused_tokens == answer_a.n_prompt_tokens + answer_a.n_generated
        w.complete(CompletionRequest(request_id="long", messages=(("user", "word " * 1500),)))
        refused = rec.next("refused")
        assert refused[1] == "long" and refused[2].reason == "context_length_exceeded"
        # a failure mid-answer: the client is told, the other front ends hear the answer
        # ended (on_error), what was decoded is saved, and the next request is served
        rec.fail_text = True
        w.complete(CompletionRequest(request_id="bug", messages=(("user", "Name a fish."),), n_predict=6))
        refused = rec.next("refused")
        assert refused[1] == "bug" and refused[2].reason == "failed" and "bug" in refused[2].message
        assert rec.of("error")[-1][1:3] == ("answer a request", "a bug in a front end")
        assert rec.of("saved")[-1][1].paused
        assert complete([("user", "Name a fish.")])[1].n_generated == 6


def test_the_benchmark_runs_and_prints_its_tables(tmp_path):
    # in its own process, as a user runs it (a window test leaves a qasync loop running in
    # this one, and the benchmark starts its own asyncio loop)
    done = subprocess.run([sys.executable, "-m", "benchmarks.server", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CHECKPOINT_CHAT_HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "right after a server restart" in out and "full recompute" in out
    assert "Concurrent clients" in out
    rows = [line.split() for line in out.split("Concurrent clients")[1].splitlines()
            if line.split()[:1] in (["1"], ["4"])]
    # one at a time and concurrent sequences, for 1, 2 and 4 clients each
    assert [(r[0], r[1]) for r in rows if r[1] in ("1", "4")] == [("1", "1"), ("1", "4"), ("4", "1"), ("4", "4")]
    # requests on one system prompt store it once: near the floor, far below a copy each
    shared = out.split("requests from the openai client")[1].splitlines()
    header = shared[1].split()
    row = dict(zip(header, (v.replace(",", "") for v in shared[3].split()), strict=True))
    assert int(row["requests"]) == 3 and int(row["system_tokens"]) > 1000
    assert float(row["store_x"]) < 1.15 and float(row["full_copies_x"]) > 2.5, row


def test_concurrent_streams_each_get_their_own_answer_as_alone(app_home, served):
    """Two clients streaming at once are answered in two sequences of one context; each
    stream carries its own answer, the text it gets alone (same seed)."""
    import threading
    server = served(app_home)
    client = server.client()
    model = client.models.list().data[0].id
    questions = [[{"role": "user", "content": "Describe the sea in a few sentences."}],
                 [{"role": "user", "content": "List some kitchen tools and what they do."}]]
    alone = [ask(client, model, q, stream=True, max_tokens=48, seed=11 + k, temperature=0.8)[0]
             for k, q in enumerate(questions)]
    together: dict = {}

    def stream(k: int) -> None:
        together[k] = ask(client, model, questions[k], stream=True, max_tokens=48, seed=11 + k, temperature=0.8)[0]
    threads = [threading.Thread(target=stream, args=(k,)) for k in range(2)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert time.perf_counter() - started < 300
    assert [together[0], together[1]] == alone
    assert alone[0] != alone[1]


@pytest.mark.parametrize("arch", ["lfm2", "mamba2"])
def test_a_hybrid_and_a_recurrent_model_restore_every_turn_across_a_restart(arch, app_home, served,
                                                                            tiny_model_path):
    """Saves used to fail for these models with a warning, and nothing was cached after a
    restart: now each turn is a head and the next turn, in a new server, restores it all."""
    messages, usages = [], []
    server = served(app_home, "-m", str(tiny_model_path(arch)))
    for k, question in enumerate(["Hello there.", "Tell me more.", "And then?"], 1):
        if k == 3:
            assert server.stop() == 0
            server = served(app_home, "-m", str(tiny_model_path(arch)))
        client = server.client()
        model = client.models.list().data[0].id
        messages.append({"role": "user", "content": question})
        text, usage, ext = ask(client, model, messages, stream=k == 2, max_tokens=8, seed=k,
                               extra_body={"ignore_eos": True})
        messages.append({"role": "assistant", "content": text})
        usages.append(usage)
        assert Path(ext["checkpoint"]).name in {h.path.name for h in heads()}
        assert "could not save" not in server.stderr().lower()
    for before, usage in pairwise(usages):
        assert usage.prompt_tokens_details.cached_tokens == before.prompt_tokens + before.completion_tokens
    assert server.stop() == 0


def test_a_request_sent_again_at_once_finds_the_prefill_its_first_try_paused(smollm_path, tmp_path):
    """A client that goes away during a long prefill and sends the same request at once (a
    retry): the second began before the first's pause was saved, found nothing stored and
    read the whole prompt again (a user's test, `serve` on a 4B-width hybrid: 1,024 tokens
    read twice).  A pause asked for lands before the next command starts."""
    from engine.requests import CompletionRequest

    with _requests_worker(smollm_path, tmp_path, n_ctx=2048) as (w, rec):
        messages = (("user", "Read this, then say one word. " + "river stone " * 700),)
        w.complete(CompletionRequest(request_id="first", messages=messages, n_predict=4, seed=1))
        rec.wait("progress")              # a chunk read, the next one being read
        w.cancel_request("first")         # the client went away ...
        w.complete(CompletionRequest(request_id="again", messages=messages, n_predict=4, seed=1))  # ... and is back
        done = rec.wait("done", 2)
        assert [d[1] for d in done] == ["first", "again"]
        first, again = rec.of("finished")[-2][1], rec.of("finished")[-1][1]
        assert first.finish_reason == "paused" and first.n_generated == 0
        assert again.n_reused_tokens >= 512, again   # the paused prefill, not read again
