"""The local server (issue 14): a long conversation after a restart, and concurrent clients.

    python -m benchmarks.server [--tokens 4000] [--answer 32] [--threads 1] [--requests 4]
                                [--conversations 10] [--parts restart,concurrency,shared] [--quick]

Part 1 — time to first token of turn 5 of a conversation of about ``--tokens`` tokens,
right after the server restarted.  Four turns, each a long user message (prose) and an
answer of ``--answer`` tokens, are sent to ``checkpoint-chat serve``; the server is
stopped and started again (nothing in memory); turn 5, a short question, is sent
streamed and timed from the request to its first token.  The same turn-5 request (the
whole conversation) then goes to a server over an empty store, which must decode all
of it: a full recompute, what every other local server does after a restart.  Reported:
the prompt tokens, how many were restored (``cached_tokens``), time to first token of
each, and whether both answers are the same text (seeded sampling).

Part 2 — requests/s and tokens/s with 1, 2 and 4 concurrent clients, each sending
``--requests`` short chat requests (``--answer`` tokens each, ``ignore_eos``) one after
another.  The engine thread serves one request at a time, so more clients queue: the
throughput stays that of one, the latency grows with the queue.

Part 3 — disk for ``--conversations`` requests from the official ``openai`` client that
share one ~1,500-token system prompt, each with its own question and a 16-token answer
(issue 25): the store's bytes once the server has stopped, against the floor, the KV
bytes of one system prompt plus each request's own tokens (llama.cpp's state size of that
many positions, measured in this process with the app's context settings), and against
what a full copy per request would take (computed the same way).

Servers run as child processes on 127.0.0.1 and free ports, in temporary homes, with
one model (SmolLM2) and one compute thread by default: on a small machine shared with
other work, llama.cpp's threads spinning at their barriers turn every stolen slice into
seconds (measured here: single requests stalling 25 s with two threads).  Exits 0
whatever the numbers; a server that fails to start ends the run with its stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Table, ctx_size_for, prompt_text  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


class ServeProcess:
    """``checkpoint-chat serve --port 0 EXTRA...`` in a child process with its own home; its
    URL from its first line (tests/test_server.py uses it too)."""

    def __init__(self, home: Path, *extra: str) -> None:
        self.err_path = home / f"serve-{time.monotonic_ns()}.err"
        self._err = open(self.err_path, "w", encoding="utf-8")
        env = dict(os.environ, CHECKPOINT_CHAT_HOME=str(home))
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--port", "0", *extra],
                                     stdout=subprocess.PIPE, stderr=self._err, text=True, cwd=str(ROOT),
                                     env=env)
        line = self.proc.stdout.readline()
        if not line.startswith("Listening on "):
            self.proc.wait(30)
            self._err.close()
            raise RuntimeError(f"serve did not start ({self.proc.returncode}): {line}{self.stderr()}")
        self.base_url = line.split()[2]          # http://127.0.0.1:PORT/v1

    def stderr(self) -> str:
        if not self._err.closed:
            self._err.flush()
        return self.err_path.read_text("utf-8")

    def stop(self) -> int:
        """SIGINT (answers in progress are paused and saved), then wait; kill after 120 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._err.close()
        return self.proc.returncode


def start_server(home: Path, n_ctx: int, threads: int, sequences: int = 4) -> ServeProcess:
    return ServeProcess(home, "-c", str(n_ctx), "-t", str(threads), "--sequences", str(sequences))


async def chat(session, url: str, messages: list[dict], *, max_tokens: int, seed: int,
               stream: bool = True) -> dict:
    """One chat request: text, usage, time to first token and total time (seconds)."""
    body = {"model": "local", "messages": messages, "max_tokens": max_tokens, "seed": seed,
            "ignore_eos": True, "stream": stream, "stream_options": {"include_usage": True}}
    body["model"] = await model_id(session, url)
    started = time.perf_counter()
    first = None
    text, usage = [], None
    async with session.post(f"{url}/chat/completions", json=body) as response:
        if response.status != 200:
            raise SystemExit(f"the server answered {response.status}: {await response.text()}")
        if not stream:
            data = await response.json()
            return {"text": data["choices"][0]["message"]["content"], "usage": data["usage"],
                    "ttft_s": None, "total_s": time.perf_counter() - started}
        async for line in response.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    return {"text": "".join(text), "usage": usage, "ttft_s": (first or time.perf_counter()) - started,
            "total_s": time.perf_counter() - started}


_MODEL_IDS: dict[str, str] = {}


async def model_id(session, url: str) -> str:
    if url not in _MODEL_IDS:
        async with session.get(f"{url}/models") as response:
            _MODEL_IDS[url] = (await response.json())["data"][0]["id"]
    return _MODEL_IDS[url]


def turn_text(tokens: int, k: int) -> str:
    """About ``tokens`` tokens of prose for user turn ``k`` (some 35 tokens a paragraph)."""
    return f"Part {k} of the archive's history follows. " + prompt_text(max(1, tokens // 35))


async def restart_table(args, work: Path) -> Table:
    import aiohttp
    t = Table(f"Turn 5 of a ~{args.tokens:,}-token conversation right after a server restart: "
              "restored from its checkpoints vs decoded in full", [
                  "how", "prompt_tokens", "cached_tokens", "ttft_s", "speedup", "same_text"])
    n_ctx = ctx_size_for(args.tokens + 8 * args.answer + 256)
    per_turn = max(40, args.tokens // 4 - args.answer)
    messages = [{"role": "system", "content": "You summarise archives."}]
    home = work / "restored"
    home.mkdir()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        server = start_server(home, n_ctx, args.threads)
        try:
            for k in range(1, 5):
                messages.append({"role": "user", "content": turn_text(per_turn, k)})
                reply = await chat(session, server.base_url, messages, max_tokens=args.answer, seed=k)
                messages.append({"role": "assistant", "content": reply["text"]})
        finally:
            server.stop()
        messages.append({"role": "user", "content": "In one sentence: what is this archive about?"})
        results = {}
        for how, folder in (("restored", home), ("full recompute", work / "empty")):
            folder.mkdir(exist_ok=True)
            server = start_server(folder, n_ctx, args.threads)
            _MODEL_IDS.pop(server.base_url, None)
            try:
                results[how] = await chat(session, server.base_url, messages, max_tokens=args.answer, seed=5)
            finally:
                server.stop()
    full = results["full recompute"]["ttft_s"]
    for how, r in results.items():
        t.add(how=how, prompt_tokens=r["usage"]["prompt_tokens"],
              cached_tokens=r["usage"]["prompt_tokens_details"]["cached_tokens"], ttft_s=r["ttft_s"],
              speedup=full / r["ttft_s"] if r["ttft_s"] else None,
              same_text=r["text"] == results["restored"]["text"])
    t.notes.append(f"SmolLM2, context {n_ctx}, {args.threads} thread(s); turns 1-4: ~{per_turn} tokens each "
                   f"and {args.answer}-token answers; time to first token from the request, the "
                   "restore (read, verify, set the state) included")
    return t


async def _client(session, url: str, c: int, requests: int, answer: int) -> list[dict]:
    """One client's replies to ``requests`` questions asked one after another."""
    replies = []
    for r in range(requests):
        question = f"Client {c}, question {r}: name a city and a river."
        replies.append(await chat(session, url, [{"role": "user", "content": question}],
                                  max_tokens=answer, seed=c * 100 + r, stream=False))
    return replies


async def concurrency_table(args, work: Path) -> Table:
    import aiohttp
    t = Table("Concurrent clients: one request at a time (--sequences 1) vs concurrent sequences (4)", [
        "sequences", "clients", "requests", "wall_s", "requests_per_s", "tokens_per_s", "mean_latency_s",
        "max_latency_s"])
    for sequences in (1, 4):
        home = work / f"concurrency-{sequences}"
        home.mkdir()
        server = start_server(home, 2048, args.threads, sequences)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
                await chat(session, server.base_url, [{"role": "user", "content": "Warm up."}], max_tokens=4, seed=0)
                for clients in (1, 2, 4):
                    started = time.perf_counter()
                    replies = await asyncio.gather(*(_client(session, server.base_url, c, args.requests, args.answer)
                                                     for c in range(clients)))
                    wall = time.perf_counter() - started
                    latencies = [r["total_s"] for rs in replies for r in rs]
                    tokens = sum(r["usage"]["completion_tokens"] for rs in replies for r in rs)
                    n = clients * args.requests
                    t.add(sequences=sequences, clients=clients, requests=n, wall_s=wall, requests_per_s=n / wall,
                          tokens_per_s=tokens / wall, mean_latency_s=sum(latencies) / n,
                          max_latency_s=max(latencies))
        finally:
            server.stop()
    t.notes.append(f"each request: a short question, {args.answer} tokens generated (ignore_eos), non-streaming; "
                   "context 2048 shared by the sequences")
    return t


def _state_bytes_per_token(n_ctx: int, threads: int) -> tuple[int, int]:
    """(fixed bytes, bytes per position) of llama.cpp's state of one sequence, SmolLM2 with
    the app's context settings: linear in the positions for a plain attention model."""
    from benchmarks.common import context_settings, model_path, prompt_tokens
    from engine.runtime import Runtime
    rt = Runtime(model_path("smollm"), context_settings(n_ctx, threads))
    try:
        sizes = []
        for n in (64, 128):
            rt.trim(0)
            rt.prefill(prompt_tokens(rt.model, n))
            sizes.append(rt.ctx.state_size(0))
    finally:
        rt.close()
    per = (sizes[1] - sizes[0]) // 64
    return sizes[0] - 64 * per, per


async def shared_prompt_table(args, work: Path) -> Table:
    from openai import OpenAI

    from benchmarks.store_footprint import QUESTIONS, SYSTEM, store_bytes  # the conversations' case
    t = Table(f"{args.conversations} requests from the openai client on one ~1,500-token system prompt: "
              "store bytes vs the KV floor", [
                  "requests", "system_tokens", "own_tokens", "floor_MB", "store_MB", "store_x",
                  "full_copies_MB", "full_copies_x", "files"])
    home = work / "shared"
    home.mkdir()
    n_ctx = 2048
    server = start_server(home, n_ctx, args.threads, 1)
    usages = []
    try:
        client = OpenAI(base_url=server.base_url, api_key="unused", timeout=3600, max_retries=0)
        model = client.models.list().data[0].id
        for i in range(args.conversations):
            reply = await asyncio.to_thread(
                client.chat.completions.create, model=model, max_tokens=16, seed=i, temperature=0,
                messages=[{"role": "system", "content": SYSTEM * 52},
                          {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (ticket {i})"}],
                extra_body={"ignore_eos": True})
            usages.append(reply.usage)
    finally:
        server.stop()
    store = home / "data" / "checkpoints"
    stored, files = store_bytes(store), len(list(store.glob("*.kvckpt")))
    fixed, per = _state_bytes_per_token(n_ctx, args.threads)
    shared = max((u.prompt_tokens_details.cached_tokens or 0) for u in usages[1:]) if len(usages) > 1 else 0
    own = sum(u.prompt_tokens + u.completion_tokens - shared for u in usages)
    floor = fixed + per * (shared + own)
    copies = sum(fixed + per * (u.prompt_tokens + u.completion_tokens) for u in usages)
    t.add(requests=len(usages), system_tokens=shared, own_tokens=own, floor_MB=floor / 1e6, store_MB=stored / 1e6,
          store_x=stored / floor, full_copies_MB=copies / 1e6, full_copies_x=copies / floor, files=files)
    t.notes.append(f"SmolLM2, context {n_ctx}, 1 sequence; system_tokens: what requests 2.. reused "
                   "(cached_tokens); floor: llama.cpp's state of those tokens once plus every request's own; "
                   f"{per:,} bytes a position; the store counted after the server stopped")
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4000, help="conversation length before turn 5")
    p.add_argument("--answer", type=int, default=32, help="tokens per answer")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--requests", type=int, default=4, help="requests per client in part 2")
    p.add_argument("--conversations", type=int, default=10, help="requests sharing a system prompt in part 3")
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--parts", default="restart,concurrency,shared",
                   help="which tables (restart, concurrency, shared)")
    args = p.parse_args(argv)
    parts = {"restart": restart_table, "concurrency": concurrency_table, "shared": shared_prompt_table}
    if args.quick:
        args.tokens, args.answer, args.requests, args.conversations = 600, 8, 2, 3
    with tempfile.TemporaryDirectory(prefix="bench-server-") as tmp:
        work = Path(tmp)
        for make in (parts[name.strip()] for name in args.parts.split(",")):
            print(asyncio.run(make(args, work)).render(), flush=True)
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
