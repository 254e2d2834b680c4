"""The file commands: ``validate``, ``compact``, ``inspect``, ``list`` — and ``info``."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine import APP_VERSION
from engine.cli.output import EXIT_ERROR, EXIT_OK, human_size, print_json
from engine.conversation import transcript_of
from engine.errors import AppError, CheckpointError
from engine.model_shape import memory_name


def cmd_validate(args) -> int:
    from engine.checkpoints import format as fmt
    from engine.checkpoints.chain import load_chain
    from engine.checkpoints.compat import ModelIdentity, Target
    from engine.checkpoints.kvstate import check_file_states

    path = Path(args.path)
    try:
        # the model first: a check that cannot be made is said before any "OK"
        model = ModelIdentity.from_gguf(_model_file(args.model)) if args.model else None
        header = fmt.read_header(path)
        print("Header OK")
        # this file and every ancestor, CRCs verified and each linked to the next
        chain = load_chain(path) if header.is_delta else [fmt.read_checkpoint(path)]
        data = chain[-1]
        print("CRC32 OK")
        fits = model is not None and Target(model).problem(replace(header, state_layout=fmt.STATE_LAYOUT)) is None
        # the model's recurrent rows only for a file of that model (else: "another model", below)
        rows = model.recurrent_rows if model is not None and fits else None
        if header.state_layout != fmt.STATE_LAYOUT:
            print(f"KV state not read: it was written in llama.cpp state layout {header.state_layout} "
                  f"(this build reads layout {fmt.STATE_LAYOUT}); opening it reads its "
                  f"{header.n_tokens} tokens again")
            for item in chain:   # (what its metadata says of its logits holds whatever the layout)
                fmt.check_logits_claim(item)
        else:
            for item in chain:
                check_file_states(item, rows)
            print(f"KV state OK ({memory_name(header.memory, header.n_swa)} memory, "
                  f"llama.cpp state layout {header.state_layout})")
        if header.is_delta:
            print(f"Chain OK (a full checkpoint and {len(chain) - 1} delta(s))")
        if model is not None:
            Target(model).check(replace(header, state_layout=fmt.STATE_LAYOUT), data.meta)
            print("Dimensions match model")
    except CheckpointError as exc:
        sys.stdout.flush()   # the lines that held come first, also where both streams are one pipe
        print(f"FAILED: {exc}", file=sys.stderr)
        return EXIT_ERROR
    finally:   # (and before any other error's line, which the command line prints)
        sys.stdout.flush()
    return EXIT_OK


def _model_file(name: str) -> Path:
    """``--model``'s file, or CheckpointError naming what is there instead."""
    path = Path(name)
    if not path.exists():
        raise CheckpointError(f"no model file at {path}")
    if not path.is_file():
        raise CheckpointError(f"{path} is no model file (a folder?)")
    return path


def cmd_compact(args) -> int:
    from engine.checkpoints.chain import load_chain
    from engine.checkpoints.graph import overwrite_problem
    from engine.compaction import compact_into, runtime_for
    from native.library import bindings, choose_library

    chain = load_chain(args.path)
    if not chain[-1].header.is_delta:
        print(f"{args.path} is already a full checkpoint")
        return EXIT_OK
    out = Path(args.output) if args.output else Path(args.path).with_name(
        Path(args.path).stem + "-full.kvckpt")
    problem = overwrite_problem(out)
    if problem:   # before loading the model
        raise AppError(problem)
    bindings(choose_library(cli_dir=args.llama_lib))
    runtime = runtime_for(chain, model=args.model, n_threads=args.threads or 0)
    try:
        info = compact_into(runtime, chain, out)
    finally:
        runtime.close()
    print(f"[CHECKPOINT] Saved to: {info.path} (size: {human_size(info.size)}; "
          f"merged {len(chain)} files)")
    return EXIT_OK


def _header_json(h) -> dict[str, Any]:
    return {
        "format_version": h.version, "title": h.title, "kind": h.kind_name,
        "conversation_id": str(h.conversation_id),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(h.created_unix_ns / 1e9)),
        "model_fingerprint": h.model_fingerprint.hex(), "model_size": h.model_size,
        "memory": memory_name(h.memory, h.n_swa), "state_layout": h.state_layout, "cell_ext": h.cell_ext,
        "n_vocab": h.n_vocab, "n_layer": h.n_layer, "n_head_kv": h.n_head_kv,
        "n_embd_head_k": h.n_embd_head_k, "n_embd_head_v": h.n_embd_head_v, "n_swa": h.n_swa,
        "n_ctx": h.n_ctx, "type_k": h.type_k, "type_v": h.type_v, "flash_attn": h.flash_attn,
        "kv_unified": h.kv_unified, "n_seq_max": h.n_seq_max, "n_tokens": h.n_tokens,
        "n_tokens_total": h.n_tokens_total, "n_generated": h.n_generated,
        "has_logits": h.has_logits, "prefill_pending": h.prefill_pending, "library": h.library,
        "sections": {"metadata": h.meta_len, "tokens": h.tokens_len, "logits": h.logits_len,
                     "state": h.state_len},
        "file_size": h.file_len,
    }


def _node_json(node, g) -> dict[str, Any]:
    """A file's place in its folder's graph (engine.checkpoints.graph)."""
    parent = g.parent(node)
    problem = g.chain_problem(node)
    return {
        "id": node.checkpoint_id,
        "parent": node.parent.file if node.parent else None,
        "parent_found": parent is not None if node.is_delta else None,
        "conversation": str(node.conversation_id), "line": node.line,
        "head": g.is_head(node),
        "needed_by_head": g.reachable(node),
        "chain": [n.name for n in g.chain(node)], "chain_size": g.chain_size(node),
        # a head's chain: bytes it alone holds, bytes other heads hold too (a shared prefix)
        "shared_size": g.footprint(node)[1] if g.is_head(node) else None,
        "chain_problem": problem,
    }


def _graph_of(path: Path):
    from engine.checkpoints.graph import Graph
    from engine.checkpoints.store import Store
    g = Graph.scan(Store(path.parent))
    return g, g.nodes.get(path.name)


def print_tree(path: Path) -> None:
    """The branches of ``path``'s conversation (in its folder) as a tree of messages:
    where they fork, and each branch's head with its token count."""
    from engine.branches import branches_of
    from engine.checkpoints.format import read_header
    from engine.checkpoints.graph import Graph
    from engine.checkpoints.store import Store
    header = read_header(path)
    g = Graph.scan(Store(path.parent))
    branches = branches_of(Store(path.parent), header.conversation_id, g)
    print(f"{header.title} ({header.conversation_id}): {len(branches)} branch(es)")

    def show(members, depth: int, indent: str) -> None:
        groups: dict = {}
        for b in members:
            if len(b.messages) > depth:
                groups.setdefault(b.messages[depth], []).append(b)
        for b in members:
            if len(b.messages) == depth:
                print(f"{indent}└ head {b.head.name}: {b.n_tokens} tokens{'  (paused)' if b.paused else ''}")
        fork = len(groups) > 1
        for (role, content), group in groups.items():
            text = " ".join(content.split())
            text = text[:70] + ("…" if len(text) > 70 else "")
            print(f"{indent}{'├ ' if fork else ''}{role}: {text}")
            show(group, depth + 1, indent + ("│ " if fork else ""))

    show(branches, 0, "")
    # a line's newer files that cannot be restored (a parent gone): no branch shows them
    broken = [n for n in g.nodes.values() if n.conversation_id == header.conversation_id
              and g.chain_problem(n) is not None
              and ((tip := g.tip_of_line.get(n.line)) is None or n.order > tip.order)]
    for n in sorted(broken, key=lambda n: n.created_ns, reverse=True):
        print(f"cannot be restored: {n.name}: {g.chain_problem(n)}")


def cmd_inspect(args) -> int:
    from engine.checkpoints import format as fmt
    from engine.checkpoints.points import point_counts
    path = Path(args.path)
    if args.tree:
        print_tree(path)
        return EXIT_OK
    header, meta = fmt.read_metadata(path)
    meta = dict(meta)
    g, node = _graph_of(path)
    place = _node_json(node, g) if node is not None else None
    if args.json:
        # "transcript": the conversation's messages as a chat shows them (the metadata holds
        # them once, in "conversation"; files written before 2026-12-04 hold both)
        print_json({"header": _header_json(header), "metadata": meta, "transcript": transcript_of(meta),
                    "turn_ends": [{"n_tokens": n, "n_messages": m} for n, m in point_counts(header, meta)],
                    "graph": place}, indent=2)
        return EXIT_OK
    for key, value in _header_json(header).items():
        print(f"{key:18} {value}")
    # the metadata's shape is not trusted: a field of another type shows as "?"
    model = _object_field(meta, "model")
    print(f"{'model':18} {model.get('name', '?')} ({model.get('path', '?')})")
    conv = _object_field(meta, "conversation")
    print(f"{'sampler':18} {json.dumps(conv.get('sampler', '?'), ensure_ascii=False)}")
    # the earlier turn ends the file holds (engine.checkpoints.points): an Edit or --from-turn
    # of one reads only from there
    ends = point_counts(header, meta)
    print(f"{'turn ends':18} " + (", ".join(f"after message {m} ({n} tokens)" for n, m in ends) or "none"))
    if place is not None:
        role = "head of its line" if place["head"] else (
            "part of a head's chain" if place["needed_by_head"] else "not needed by any head")
        print(f"{'place':18} {role}")
        print("chain:" + (f"  BROKEN: {place['chain_problem']}" if place["chain_problem"] else ""))
        names = place["chain"]
        for i, name in enumerate(names):
            member = g.nodes[name]
            what = "delta" if member.is_delta else "full"
            start = g.nodes[names[i + 1]].header.parent_n_tokens if i + 1 < len(names) else 0
            # a cut (engine.checkpoints.chain.can_cut): the next file builds on fewer of its tokens
            used = f"  (its first {start} used)" if 0 < start < member.header.n_tokens else ""
            print(f"  {what:5} {member.header.n_tokens:7d} tok  {human_size(member.size):>9}  {name}{used}")
        print(f"  total {human_size(place['chain_size'])}")
    print("transcript:")
    for message in transcript_of(meta):
        content = message["content"]
        more = "" if message.get("complete", True) else "  [paused]"
        print(f"  {message['role']}: {content[:200]}{'…' if len(content) > 200 else ''}{more}")
    return EXIT_OK


def _object_field(meta: dict, key: str) -> dict:
    """``meta[key]`` when it is a JSON object, else an empty one."""
    value = meta.get(key)
    return value if isinstance(value, dict) else {}


def cmd_list(args) -> int:
    from engine.checkpoints.graph import Graph
    from engine.checkpoints.store import Store
    if args.dir is not None and not Path(args.dir).is_dir():   # (the default folder may not exist yet)
        raise AppError(f"{args.dir} is not a folder" if Path(args.dir).exists() else f"no such folder: {args.dir}")
    store = Store(args.dir)
    g = Graph.scan(store)
    nodes = sorted(g.nodes.values(), key=lambda n: n.created_ns, reverse=True)
    if args.json:
        out = [{"path": str(n.path), "size": n.size, "valid": True, "error": None,
                "header": _header_json(n.header), **_node_json(n, g)} for n in nodes]
        out += [{"path": str(u.path), "size": u.size, "valid": False, "error": u.error,
                 "id": None, "parent": None, "conversation": None, "head": False}
                for u in g.unreadable]
        print_json(out, indent=2)
        return EXIT_OK
    if not nodes and not g.unreadable:
        print("no checkpoints")
        return EXIT_OK
    # heads first, newest first, each with the files its chain needs folded under it
    shown: set[str] = set()
    for head in g.heads:
        chain = g.chain(head)
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(head.created_ns / 1e9))
        h = head.header
        shared = g.footprint(head)[1]
        extra = f"  ({len(chain)} files, {human_size(g.chain_size(head))}" if len(chain) > 1 else ""
        if extra:
            extra += f", {human_size(shared)} shared)" if shared else ")"
        print(f"{when}  {h.kind_name:8} {h.n_tokens:6d} tok  {human_size(head.size):>9}  "
              f"{h.title}  [{head.path}]{extra}")
        for member in reversed(chain[:-1]):
            if member.name not in shown:
                print(f"{'':18}  └ {member.header.kind_name:8} {member.header.n_tokens:6d} tok  "
                      f"{human_size(member.size):>9}  {member.name}")
        shown.update(n.name for n in chain)
    others = [n for n in nodes if n.name not in shown]
    if others or g.unreadable:
        # under a line of their own: printed on after the last head, they read as its files
        print("in no head's chain:")
    for n in others:
        why = g.chain_problem(n) or "superseded by a newer head of its line"
        print(f"{'':18}  {n.header.kind_name:8} {n.header.n_tokens:6d} tok  {human_size(n.size):>9}  "
              f"{n.name}  ({why})")
    for u in g.unreadable:
        print(f"{'':18}  CORRUPT  {u.error}  [{u.path}]")
    return EXIT_OK


def cmd_info(args) -> int:
    from engine.models import default_model_path
    from native.library import REQUIRED_LLAMA_CPP_COMMIT, bindings, choose_library, system_info
    from native.rpc import rpc_problem

    bindings(choose_library(cli_dir=args.llama_lib))
    info = system_info()
    rpc_missing = rpc_problem()
    remote: list[dict] = []
    if args.rpc:
        from engine.cli.rpc import connect_workers, print_remote_devices
        workers = connect_workers(args.rpc, args.rpc_timeout)   # refuses with one sentence
    try:
        model = str(default_model_path())
    except AppError as exc:
        model = f"not installed ({exc})"
    if args.json:
        if args.rpc:
            remote = print_remote_devices(workers, as_json=True)
        print(json.dumps({"version": APP_VERSION, "library": info.library_path,
                          "library_version": info.library_version, "bundled": info.bundled,
                          "required_commit": REQUIRED_LLAMA_CPP_COMMIT,
                          "gpu_offload": info.gpu_offload, "features": info.features,
                          "devices": [d.__dict__ for d in info.devices], "default_model": model,
                          "rpc": rpc_missing is None, "remote_devices": remote},
                         indent=2))
        return EXIT_OK
    print(f"Checkpoint Chat {APP_VERSION}")
    print(f"llama library   {info.library_path} ({'bundled' if info.bundled else 'user-chosen'}, "
          f"{info.library_version}; needs llama.cpp commit {REQUIRED_LLAMA_CPP_COMMIT})")
    # llama.cpp reports offload support whenever the RPC backend is built in, GPU or not
    local_gpu = any(d.kind in ("GPU", "iGPU") for d in info.devices)
    offload = "yes" if local_gpu else ("to remote workers only (no GPU here)" if info.gpu_offload else "no")
    print(f"GPU offload     {offload}")
    rpc_line = "yes (remote workers: --rpc, rpc-worker)" if rpc_missing is None else f"no: {rpc_missing}"
    print(f"RPC backend     {rpc_line}")
    print(f"CPU features    {info.features}")
    for d in info.devices:
        print(f"device          {d.kind} {d.name}: {d.description}, "
              f"{human_size(d.memory_free)} free of {human_size(d.memory_total)}")
    if args.rpc:
        print_remote_devices(workers)
    print(f"default model   {model}")
    return EXIT_OK
