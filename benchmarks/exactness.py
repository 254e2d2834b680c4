"""Which KV cache settings restore a state bit-exactly?  Prints a table, exits 0.

For each model and KV setting: prefill a long text to position p (in batch-aligned
chunks), decode 8 tokens one at a time, save the sequence state, load it into a fresh
context, decode 40 more tokens; compare the final logits with a run that never
restored.  0 means bit-exact.  Usage: python benchmarks/exactness.py [--positions ...]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def run(model, tokens, split, settings, restore: bool) -> np.ndarray:
    from native.context import Context
    ctx = Context(model, settings)
    try:
        step = settings.n_batch
        for pos in range(0, split, step):
            end = min(split, (pos // step + 1) * step)
            ctx.decode(tokens[pos:end], pos, logits_last=end == split)
        for i in range(split, split + 48):
            if restore and i == split + 8:
                size = ctx.state_size()
                buf = bytearray(size)
                ctx.state_get_into(buf, size)
                ctx.close()
                ctx = Context(model, settings)
                ctx.state_set_from(buf, size)
            ctx.decode(tokens[i:i + 1], i)
        return ctx.logits_last().copy()
    finally:
        ctx.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--positions", default="300,700,1300,2100")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    from engine.models import default_model_path, gemma_model_path
    from native.context import KV_TYPES, ContextSettings
    from native.model import Model

    positions = [int(x) for x in args.positions.split(",")]
    configs = {
        "f16, no flash attention": dict(flash_attn=False, type_k=KV_TYPES["f16"], type_v=KV_TYPES["f16"]),
        "f16, flash attention": dict(flash_attn=True, type_k=KV_TYPES["f16"], type_v=KV_TYPES["f16"]),
        "q8_0, flash attention": dict(flash_attn=True, type_k=KV_TYPES["q8_0"], type_v=KV_TYPES["q8_0"]),
    }
    text = "The quick brown fox jumps over the lazy dog, said Alice to the curious cat. " * 300
    rows = []
    for label, path in (("SmolLM2-135M", default_model_path()), ("Gemma 3 270M", gemma_model_path())):
        with Model(path) as model:
            tokens = model.tokenize(text, add_special=True)[:max(positions) + 64]
            for name, kw in configs.items():
                settings = ContextSettings(n_ctx=4096, n_threads=args.threads, **kw)
                diffs = [float(np.abs(run(model, tokens, s, settings, True)
                                      - run(model, tokens, s, settings, False)).max()) for s in positions]
                rows.append((label, name, diffs))
    print(f"max |logit difference| after restore, at positions {positions}")
    print(f"{'model':14} {'KV cache':26} differences")
    for label, name, diffs in rows:
        print(f"{label:14} {name:26} " + " ".join(f"{d:.2f}" if d else "0" for d in diffs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
