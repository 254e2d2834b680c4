"""Turning the command line's arguments into settings: context, sampler, model file.

Shared by ``run``, ``run --parallel`` and ``serve`` (each a front end of the same engine).
"""

from __future__ import annotations

from pathlib import Path


def context_settings(args, header):
    from native.context import KV_TYPES, ContextSettings
    from native.errors import ContextError

    def kv_type(name: str | None, fallback: int) -> int:
        if name is None:
            return fallback
        if name not in KV_TYPES:
            raise ContextError(f"unknown KV cache type {name!r} (choose from {', '.join(KV_TYPES)})")
        return KV_TYPES[name]

    base = ContextSettings()
    n_ctx = args.ctx_size or (header.n_ctx if header else base.n_ctx)
    return ContextSettings(
        n_ctx=n_ctx, n_batch=args.batch_size or base.n_batch,
        n_ubatch=args.batch_size or base.n_ubatch, n_threads=args.threads or 0,
        flash_attn=(args.flash_attn == "on") if args.flash_attn else (header.flash_attn if header else base.flash_attn),
        type_k=kv_type(args.cache_type_k, header.type_k if header else base.type_k),
        type_v=kv_type(args.cache_type_v, header.type_v if header else base.type_v),
        n_seq_max=header.n_seq_max if header else base.n_seq_max,
        kv_unified=header.kv_unified if header else base.kv_unified)


def sampler_from_args(args, base):
    """The flags given, over ``base``: a resumed answer's sampler, or the model's defaults."""
    from engine.sampling import SamplerSettings, random_seed
    if args.seed is None:
        seed = base.seed          # a resumed answer keeps its seed
    elif args.seed < 0:
        seed = random_seed()      # llama.cpp's convention: -1 means random
    else:
        seed = args.seed
    pick = lambda value, default: default if value is None else value  # noqa: E731
    return SamplerSettings(
        temperature=pick(args.temp, base.temperature), top_k=pick(args.top_k, base.top_k),
        top_p=pick(args.top_p, base.top_p), min_p=pick(args.min_p, base.min_p),
        repeat_penalty=pick(args.repeat_penalty, base.repeat_penalty),
        repeat_last_n=pick(args.repeat_last_n, base.repeat_last_n), seed=seed,
        ignore_eos=pick(args.ignore_eos, base.ignore_eos))


def model_path(args, meta: dict | None) -> Path:
    """``-m``, else the model the checkpoint continued names (engine.models.model_for_checkpoint)."""
    from engine.models import model_for_checkpoint
    return model_for_checkpoint(meta, args.model)
