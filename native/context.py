"""A llama.cpp context: decode, abort, logits, KV memory and sequence state.

:class:`Context` owns one ``llama_context`` and the batch it decodes with.  It is not
thread-safe (llama.cpp's decode is not): one engine thread owns it.  The only method
other threads may call is :meth:`request_abort`, which sets a flag that llama.cpp's
abort callback reads between graph nodes on the CPU backend.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from native.errors import ContextError, DecodeError, StateError
from native.library import bindings
from native.logs import failure_reason, take_errors
from native.model import Model

#: llama_decode return values (llama.h)
DECODE_OK = 0
DECODE_NO_SLOT = 1
DECODE_ABORTED = 2

#: ggml_type ids for the KV cache types users may pick
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}

#: How llama.cpp's compute threads are scheduled (ContextSettings.compute_priority):
#: "normal" as llama.cpp does by default; "low" lets the rest of the process (a
#: window's UI thread) run first whenever it wants a core (see ComputeThreads).
COMPUTE_PRIORITIES = ("normal", "low")

log = logging.getLogger("native")


#: llama.h's LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: for a hybrid memory, its recurrent part only
STATE_RECURRENT_ONLY = 1


@dataclass(frozen=True)
class ContextSettings:
    """Everything that shapes the KV cache, and so decides whether a state fits.

    Defaults are chosen for the determinism contract.  Measured on this llama.cpp
    build (CPU, 2 threads; max |difference| of logits 40 tokens after restoring a state
    taken at 300 / 700 / 1,300 / 2,100 tokens, against the same run never restored;
    ``python benchmarks/exactness.py`` reproduces it):

    ==================  ==============  ===============================
    KV cache            SmolLM2-135M    Gemma 3 270M (sliding window)
    ==================  ==============  ===============================
    f16, no FA          0 0 0 0         0 0 0 0.64
    f16, flash attn     0 0 0 0         0 0.98 1.08 1.17
    q8_0, flash attn    0 0 0 0         0 0 0 0
    ==================  ==============  ===============================

    Only q8_0 with flash attention restores both models bit-exactly at every length; it
    also halves the KV cache and the checkpoints, at a quality cost llama.cpp's own
    measurements put within noise.  Users may pick other types; the checkpoint header
    records them and a resume must use the same.
    """
    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int = 0          # 0: llama.cpp's choice of physical cores
    flash_attn: bool = True
    type_k: int = KV_TYPES["q8_0"]
    type_v: int = KV_TYPES["q8_0"]
    n_seq_max: int = 2          # sequence 1 is scratch space for delta checkpoints
    kv_unified: bool = True
    #: scheduling only: no effect on results, not part of a checkpoint's context shape
    compute_priority: str = "normal"

    def __post_init__(self) -> None:
        for name in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max"):
            if getattr(self, name) <= 0:
                raise ContextError(f"{name.replace('_', ' ')} must be positive, not {getattr(self, name)}")
        if self.n_threads < 0:
            raise ContextError(f"the thread count must be 0 (automatic) or more, not {self.n_threads}")
        if self.compute_priority not in COMPUTE_PRIORITIES:
            raise ContextError(f"unknown compute priority {self.compute_priority!r} "
                               f"(choose from {', '.join(COMPUTE_PRIORITIES)})")

    @property
    def supports_deltas(self) -> bool:
        """Delta checkpoints copy cells into scratch sequence 1 of one shared buffer."""
        return self.n_seq_max >= 2 and self.kv_unified


class _AbortSource:
    """What llama.cpp's abort callback consults: a flag and the caller's stop condition."""
    __slots__ = ("event", "check")

    def __init__(self, event: threading.Event) -> None:
        self.event = event
        self.check: Callable[[], bool] | None = None

    def should_abort(self) -> bool:
        try:
            return self.event.is_set() or bool(self.check is not None and self.check())
        except Exception:  # never let an exception cross into C
            return False


class _ThreadpoolParams(ctypes.Structure):
    """struct ggml_threadpool_params (ggml.h)."""
    _fields_ = [("cpumask", ctypes.c_bool * 512),       # GGML_MAX_N_THREADS
                ("n_threads", ctypes.c_int),
                ("prio", ctypes.c_int),                  # enum ggml_sched_priority
                ("poll", ctypes.c_uint32),
                ("strict_cpu", ctypes.c_bool),
                ("paused", ctypes.c_bool)]


GGML_SCHED_PRIO_LOW = -1


def _ggml_library_names(stem: str, platform: str = sys.platform) -> tuple[str, ...]:
    if platform == "win32":
        return (f"{stem}.dll", f"lib{stem}.dll")
    if platform == "darwin":
        return (f"lib{stem}.dylib", f"lib{stem}.so")
    return (f"lib{stem}.so",)


class ComputeThreads:
    """llama.cpp's compute threads for one context, at low priority.

    By default each decode runs on a threadpool llama.cpp makes for it, at the caller's
    priority: on a machine with as many cores as threads, the window's UI thread then
    waits for a core like any other thread.  Here a ggml threadpool with
    ``GGML_SCHED_PRIO_LOW`` is attached to the context: every thread that computes
    (the caller included) applies that priority itself (Windows:
    ``THREAD_PRIORITY_BELOW_NORMAL``; Linux: ``SCHED_BATCH``).  Linux's ``SCHED_BATCH``
    alone barely changes who runs first, so on Linux the calling thread's nice value is
    raised by :data:`LINUX_NICE` too, before its first decode: the OpenMP workers ggml
    starts from it then inherit it.  Nice values are per thread on Linux, so only the
    engine thread and its workers are affected, never the UI thread.  Raising a nice
    value cannot be undone without privileges: use this on a thread that only computes.

    When the library lacks what this needs (a CPU backend built as loadable variants,
    another build), nothing is changed and the reason is logged.
    """

    #: how much lower (higher nice) the compute threads run on Linux; read at attach time
    LINUX_NICE = 10

    def __init__(self, ll, ctx_ptr, n_threads: int, folder: Path | None) -> None:
        self._ll = ll
        self._ctx = ctx_ptr
        # (pool, ggml_threadpool_free, llama_detach_threadpool) once attached; None before
        self._attached: tuple[int, Callable[[int], None], Callable[[Any], None]] | None = None
        self.applied: list[str] = []
        try:
            base, cpu = (_open_beside(folder, stem) for stem in ("ggml-base", "ggml-cpu"))
            init = base.ggml_threadpool_params_init
            init.argtypes, init.restype = [ctypes.POINTER(_ThreadpoolParams), ctypes.c_int], None
            new = cpu.ggml_threadpool_new
            new.argtypes, new.restype = [ctypes.POINTER(_ThreadpoolParams)], ctypes.c_void_p
            free = cpu.ggml_threadpool_free
            free.argtypes, free.restype = [ctypes.c_void_p], None
            attach = ll._lib.llama_attach_threadpool
            attach.argtypes, attach.restype = [ctypes.c_void_p] * 3, None
            detach = ll._lib.llama_detach_threadpool
            detach.argtypes, detach.restype = [ctypes.c_void_p], None
        except (OSError, AttributeError) as exc:
            log.warning("compute threads stay at normal priority: %s", exc)
            return
        # void ggml_threadpool_params_init(struct ggml_threadpool_params * p, int n_threads)
        params = _ThreadpoolParams()
        init(ctypes.byref(params), n_threads)
        params.prio = GGML_SCHED_PRIO_LOW
        # struct ggml_threadpool * ggml_threadpool_new(struct ggml_threadpool_params * params)
        pool = new(ctypes.byref(params))
        if not pool:
            log.warning("compute threads stay at normal priority: ggml_threadpool_new failed")
            return
        # void llama_attach_threadpool(struct llama_context * ctx, ggml_threadpool_t threadpool,
        #                              ggml_threadpool_t threadpool_batch)
        attach(ctx_ptr, pool, pool)
        self._attached = (pool, free, detach)
        self.applied.append("ggml threadpool priority low")
        if sys.platform.startswith("linux") and self.LINUX_NICE > 0:
            tid = threading.get_native_id()
            try:
                now = os.getpriority(os.PRIO_PROCESS, tid)
                os.setpriority(os.PRIO_PROCESS, tid, min(19, max(now, self.LINUX_NICE)))
                self.applied.append(f"nice {os.getpriority(os.PRIO_PROCESS, tid)}")
            except OSError as exc:
                log.warning("could not lower the compute threads' priority: %s", exc)

    def close(self) -> None:
        """Detach and free the pool (before the context is freed)."""
        attached, self._attached = self._attached, None
        if attached:
            pool, free, detach = attached
            # void llama_detach_threadpool(struct llama_context * ctx)
            detach(self._ctx)
            # void ggml_threadpool_free(struct ggml_threadpool * threadpool)
            free(pool)


def _open_beside(folder: Path | None, stem: str) -> ctypes.CDLL:
    """One of ggml's libraries, from the folder libllama was loaded from."""
    names = _ggml_library_names(stem)
    for name in names:
        if folder is not None and (folder / name).is_file():
            return ctypes.CDLL(str(folder / name))
    raise OSError(f"{' or '.join(names)} not found beside libllama in {folder}")


class Context:
    """One llama context with its decode batch."""

    def __init__(self, model: Model, settings: ContextSettings) -> None:
        ll = self._ll = bindings()
        self.model = model
        self.settings = settings
        params = ll.llama_context_default_params()
        params.n_ctx = settings.n_ctx
        # llama.cpp reserves one output per sequence when it makes the context and aborts
        # the process (GGML_ASSERT n_outputs_max) when its batch is smaller: a batch of 3
        # with 5 sequences (a parallel runtime's 4 and a scratch one) did.  The prefill chunk
        # stays the one asked for (decode refuses more; llama.cpp splits into ubatches of it).
        params.n_batch = max(settings.n_batch, settings.n_seq_max)
        params.n_ubatch = min(settings.n_ubatch, settings.n_batch)
        params.n_seq_max = settings.n_seq_max
        threads = settings.n_threads or _physical_cores()
        params.n_threads = threads
        params.n_threads_batch = threads
        params.flash_attn_type = 1 if settings.flash_attn else 0
        params.type_k = settings.type_k
        params.type_v = settings.type_v
        params.kv_unified = settings.kv_unified
        # a sliding window keeps every cell it decoded (llama.cpp's default, said here):
        # dropping a tail, a shared prefix and a delta's parent rely on it (engine.snapshots)
        params.swa_full = True
        params.no_perf = True
        self._abort = threading.Event()
        self._abortable = False  # only decodes started with abortable=True may be cut short
        # The callback reads a small holder, not self: no reference cycle through a
        # CFUNCTYPE, so the context is freed in order by refcounting.  ``check`` is the
        # caller's own stop condition (engine.generation.Control), read directly, so a
        # pause from another thread never has to reach into the context.
        src = self._abort_source = _AbortSource(self._abort)
        # bool (*ggml_abort_callback)(void * data): kept referenced for the context's life.
        # Installed only around abortable decodes (see decode): llama.cpp calls it after
        # every graph node (~600 per token), each call taking the GIL.
        self._abort_cb = ll.ggml_abort_callback(lambda _data: src.should_abort())
        self._no_abort_cb = ll.ggml_abort_callback()  # NULL: nothing to call
        take_errors()   # what llama.cpp logs from here on is this call's
        # llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params)
        self._ptr = ll.llama_init_from_model(model.ptr, params)
        if not self._ptr:
            reason = failure_reason("not enough memory, or unsupported settings")
            raise ContextError(f"llama.cpp could not create a context of {settings.n_ctx} tokens ({reason})")
        self._threads: ComputeThreads | None = None
        try:
            self._init_batch(ll, model, settings, threads)
            if settings.compute_priority == "low":
                from native.library import loaded_library
                self._threads = ComputeThreads(ll, self._ptr, threads, loaded_library().folder)
        except BaseException:
            self.close()  # never leave a half-built context for the garbage collector
            raise

    def _init_batch(self, ll, model: Model, settings: ContextSettings, threads: int) -> None:
        self.n_ctx = ll.llama_n_ctx(self._ptr)
        self.n_threads = threads
        self._mem = ll.llama_get_memory(self._ptr)
        self._batch = ll.llama_batch_init(settings.n_batch, 0, 1)
        self._batch_owned = True
        b = self._batch
        n = settings.n_batch
        self._b_token = np.ctypeslib.as_array(b.token, shape=(n,))
        self._b_pos = np.ctypeslib.as_array(b.pos, shape=(n,))
        self._b_nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(n,))
        self._b_logits = np.ctypeslib.as_array(b.logits, shape=(n,))
        self._b_seq0 = [b.seq_id[i] for i in range(n)]
        for i in range(n):
            self._b_seq0[i][0] = 0
        self._b_nseq[:] = 1
        self.n_vocab = model.shape.n_vocab
        self._can_abort = model.can_abort_mid_batch   # see Model.can_abort_mid_batch
        self._logits_address = 0
        self._logits_view: np.ndarray | None = None

    # -- ownership -------------------------------------------------------------------
    @property
    def ptr(self):
        if not self._ptr:
            raise ContextError("the context was closed")
        return self._ptr

    def close(self) -> None:
        if getattr(self, "_batch_owned", False):
            self._batch_owned = False
            self._ll.llama_batch_free(self._batch)
        threads, self._threads = getattr(self, "_threads", None), None
        if threads is not None:
            threads.close()
        ptr, self._ptr = getattr(self, "_ptr", None), None
        if ptr:
            self._ll.llama_free(ptr)

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    # -- abort -----------------------------------------------------------------------
    def request_abort(self) -> None:
        """Ask a running decode to stop at its next check (any thread may call this)."""
        self._abort.set()

    def clear_abort(self) -> None:
        self._abort.clear()

    @property
    def abort_requested(self) -> bool:
        return self._abort.is_set()

    # -- decode ----------------------------------------------------------------------
    def decode(self, tokens: Sequence[int] | np.ndarray, pos0: int, *, logits_last: bool = True,
               abortable: bool = False, should_abort: Callable[[], bool] | None = None) -> int:
        """Decode ``tokens`` at positions ``pos0...`` in sequence 0.

        Returns DECODE_OK, or DECODE_ABORTED when ``abortable`` and an abort was
        requested (the ubatches already processed stay in memory: read
        :meth:`pos_max`).  Recurrent and hybrid memories are never cut inside a decode
        (Model.can_abort_mid_batch): their decodes run to the end.  A single-token decode
        is never made abortable by the engine: pausing between tokens costs at most one
        token's time and keeps its logits.
        Raises on failure.
        """
        n = len(tokens)
        if n == 0 or n > self.settings.n_batch:
            raise DecodeError(f"cannot decode {n} tokens at once (batch holds {self.settings.n_batch})")
        b = self._batch
        b.n_tokens = n
        if n == 1:   # one generated token: no temporary arrays
            self._b_token[0] = tokens[0]
            self._b_pos[0] = pos0
            self._b_logits[0] = 1 if logits_last else 0
        else:
            self._b_token[:n] = tokens
            self._b_pos[:n] = np.arange(pos0, pos0 + n, dtype=np.int32)
            self._b_logits[:n] = 0
            if logits_last:
                self._b_logits[n - 1] = 1
        return self.decode_batch(b, abortable=abortable, should_abort=should_abort)

    def decode_batch(self, batch, *, abortable: bool = False,
                     should_abort: Callable[[], bool] | None = None) -> int:
        """``llama_decode`` of a filled ``llama_batch`` (this context's own, or a
        native.batch.SeqBatch's), with :meth:`decode`'s abort rules and return codes."""
        abortable = abortable and self._can_abort
        self._abortable = abortable
        self._abort_source.check = should_abort if abortable else None
        if abortable:
            # void llama_set_abort_callback(struct llama_context * ctx,
            #                               ggml_abort_callback abort_callback, void * abort_callback_data)
            self._ll.llama_set_abort_callback(self.ptr, self._abort_cb, None)
        try:
            # int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch)
            rc = self._ll.llama_decode(self.ptr, batch)
        finally:
            self._abortable = False
            self._abort_source.check = None
            if abortable:
                self._ll.llama_set_abort_callback(self.ptr, self._no_abort_cb, None)
        if rc == DECODE_OK or rc == DECODE_ABORTED:
            return rc
        if rc == DECODE_NO_SLOT:
            raise DecodeError("no room left in the KV cache for this batch")
        raise DecodeError(f"llama_decode failed with code {rc}")

    def logits_last(self) -> np.ndarray:
        """The last decoded position's logits, as a view valid until the next decode."""
        # float * llama_get_logits_ith(struct llama_context * ctx, int32_t i)
        ptr = self._ll.llama_get_logits_ith(self.ptr, -1)
        if not ptr:
            raise DecodeError("no logits available for the last position")
        # one generated token after another finds its logits at the same address: the
        # view made for it is reused (making one costs more than the rest of the loop)
        address = ctypes.addressof(ptr.contents)
        if address != self._logits_address:
            self._logits_view = view = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
            self._logits_address = address
            return view
        assert self._logits_view is not None  # set together with _logits_address above
        return self._logits_view

    # -- KV memory ---------------------------------------------------------------------
    def pos_max(self, seq: int = 0) -> int:
        """Highest position held for ``seq`` (-1 when empty)."""
        return int(self._ll.llama_memory_seq_pos_max(self._mem, seq))

    def pos_min(self, seq: int = 0) -> int:
        return int(self._ll.llama_memory_seq_pos_min(self._mem, seq))

    def clear(self, data: bool = True) -> None:
        """Empty every sequence; ``data=False`` frees the cells without zeroing the cache's
        bytes (a memset of the whole cache: ~2.5 ms per 100 MB), as removing cells does."""
        # void llama_memory_clear(llama_memory_t mem, bool data)
        self._ll.llama_memory_clear(self._mem, data)

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of ``seq``; False when the memory cannot (SWA, recurrent)."""
        return bool(self._ll.llama_memory_seq_rm(self._mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self._ll.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    # -- sequence state ------------------------------------------------------------------
    def state_size(self, seq: int = 0, flags: int = 0) -> int:
        """Bytes of ``seq``'s state; ``flags`` STATE_RECURRENT_ONLY: a hybrid's recurrent part."""
        if flags:
            # size_t llama_state_seq_get_size_ext(ctx, llama_seq_id seq_id, llama_state_seq_flags flags)
            return int(self._ll.llama_state_seq_get_size_ext(self.ptr, seq, flags))
        # size_t llama_state_seq_get_size(struct llama_context * ctx, llama_seq_id seq_id)
        return int(self._ll.llama_state_seq_get_size(self.ptr, seq))

    def synchronize(self) -> None:
        """Wait until the backend (CUDA) has finished every queued computation.

        On CUDA a pause lands between decode calls and the last one may still be
        running on the device; a save must read the KV cache after it, not during.
        """
        # void llama_synchronize(struct llama_context * ctx)
        self._ll.llama_synchronize(self.ptr)

    def state_get_into(self, buffer, size: int, seq: int = 0, flags: int = 0) -> int:
        """Copy ``seq``'s state into ``buffer`` (any writable ctypes-compatible buffer)."""
        self.synchronize()  # llama.cpp does it too; explicit, as the save depends on it
        dst = (ctypes.c_uint8 * size).from_buffer(buffer)
        if flags:
            # size_t llama_state_seq_get_data_ext(ctx, uint8_t * dst, size_t size, llama_seq_id seq_id, flags)
            written = int(self._ll.llama_state_seq_get_data_ext(self.ptr, dst, size, seq, flags))
        else:
            # size_t llama_state_seq_get_data(ctx, uint8_t * dst, size_t size, llama_seq_id seq_id)
            written = int(self._ll.llama_state_seq_get_data(self.ptr, dst, size, seq))
        if written == 0:
            raise StateError("llama.cpp could not write the sequence state")
        return written

    def state_set_from(self, buffer, size: int, seq: int = 0, flags: int = 0) -> int:
        """Load ``seq``'s state from the first ``size`` bytes of ``buffer`` (any contiguous
        buffer, a read-only one too: a mapped checkpoint; llama.cpp only reads it, in
        place); on failure the sequence may be cleared.  With ``flags``
        STATE_RECURRENT_ONLY only a hybrid's recurrent part is replaced."""
        source = np.frombuffer(buffer, dtype=np.uint8)   # no copy; keeps the buffer alive
        if size < 0 or size > len(source):
            raise ValueError(f"a state of {size} bytes does not fit a buffer of {len(source)}")
        src = source.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        if flags:
            # size_t llama_state_seq_set_data_ext(ctx, const uint8_t * src, size_t size, dest_seq_id, flags)
            read = int(self._ll.llama_state_seq_set_data_ext(self.ptr, src, size, seq, flags))
        else:
            # size_t llama_state_seq_set_data(ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id)
            read = int(self._ll.llama_state_seq_set_data(self.ptr, src, size, seq))
        if read == 0:
            raise StateError("llama.cpp refused the sequence state")
        return read


def _physical_cores() -> int:
    import os
    count = os.cpu_count() or 2
    # llama.cpp's own default is "physical cores"; hyper-threads slow decoding down.
    return max(1, count // 2) if count >= 8 else count
