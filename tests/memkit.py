"""What the memory-kind tests share: one answer's fingerprint (its text, the last logits
and the sequence state, as bytes), made the same way in this process and in a child.

``python tests/memkit.py MODEL CHECKPOINT`` restores CHECKPOINT in a fresh process,
continues its answer to the end and prints the fingerprint as JSON: resuming in a new
process is the user's case, and comparing logits and state bytes (not only text) is what
proves exactness with random tiny models, whose text says little.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.checkpoints.chain import load_chain  # noqa: E402
from engine.conversation import Conversation  # noqa: E402
from engine.generation import begin_answer, generate  # noqa: E402
from engine.runtime import Runtime  # noqa: E402
from engine.sampling import SamplerSettings  # noqa: E402
from native.context import ContextSettings  # noqa: E402

SETTINGS = ContextSettings(n_ctx=1024, n_batch=32, n_ubatch=32, n_threads=2)
PROMPT = "Tell me a long story about a lighthouse keeper and the sea. " * 12
N_PREDICT = 24


def conversation(rt: Runtime, *, temperature: float = 0.8) -> Conversation:
    conv = Conversation(sampler=SamplerSettings(temperature=temperature, seed=11, ignore_eos=True))
    begin_answer(conv, rt, PROMPT, n_predict=N_PREDICT)
    return conv


def state_bytes(rt: Runtime, seq: int = 0) -> bytes:
    size = rt.ctx.state_size(seq)
    buf = np.empty(size, dtype=np.uint8)
    return bytes(buf[:rt.ctx.state_get_into(buf, size, seq)])


def fingerprint(rt: Runtime, text: str) -> dict:
    logits = np.asarray(rt.logits(), dtype=np.float32).tobytes()
    return {"text": text, "n_tokens": len(rt.kv_tokens),
            "logits": hashlib.sha256(logits).hexdigest(),
            "state": hashlib.sha256(state_bytes(rt)).hexdigest()}


def continue_checkpoint(model: str | Path, checkpoint: str | Path) -> dict:
    rt = Runtime(model, SETTINGS)
    try:
        conv = rt.restore_chain(load_chain(Path(checkpoint)))
        rest = generate(rt, conv)
        return fingerprint(rt, rest.text)
    finally:
        rt.close()


if __name__ == "__main__":
    print(json.dumps(continue_checkpoint(sys.argv[1], sys.argv[2])))
