"""Issue 13, the window's responsiveness: llama.cpp's compute threads at low priority.

``ContextSettings(compute_priority="low")`` attaches a ggml threadpool whose threads
lower their own priority; on Linux the engine thread's nice value rises too, and the
OpenMP workers it starts inherit it.  Scheduling must never change a result, and must
never touch a thread that does not compute (the UI thread).
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from native.context import ComputeThreads, ContextSettings
from native.errors import ContextError

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")


def test_unknown_priority_is_refused():
    with pytest.raises(ContextError, match="compute priority"):
        ContextSettings(compute_priority="urgent")


def test_priority_is_not_part_of_the_context_shape():
    from engine.checkpoints.compat import ContextShape
    assert ContextShape.of(ContextSettings(compute_priority="low")) == ContextShape.of(ContextSettings())


def _in_thread(fn):
    """Run ``fn`` on a fresh thread (priorities raised there die with it)."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the test
            box["error"] = exc
    t = threading.Thread(target=target, name="engine-test")
    t.start()
    t.join(300)
    if "error" in box:
        raise box["error"]
    return box["value"]


def _logits(smollm_path, priority: str):
    from engine.runtime import Runtime
    rt = Runtime(smollm_path, ContextSettings(n_ctx=512, n_threads=2, compute_priority=priority))
    try:
        tokens = rt.model.tokenize("The lighthouse keeper counted the ships. " * 12, add_special=True)
        rt.prefill(tokens)
        first = np.array(rt.logits(), copy=True)
        rt.decode_token(int(np.argmax(first)))
        tid = threading.get_native_id()
        applied = list(rt.ctx._threads.applied) if rt.ctx._threads else []
        policy = os.sched_getscheduler(tid) if hasattr(os, "sched_getscheduler") else None
        nice = os.getpriority(os.PRIO_PROCESS, tid) if hasattr(os, "getpriority") else None
        return first, np.array(rt.logits(), copy=True), applied, policy, nice
    finally:
        rt.close()


def test_low_priority_changes_no_result(smollm_path):
    normal = _in_thread(lambda: _logits(smollm_path, "normal"))
    low = _in_thread(lambda: _logits(smollm_path, "low"))
    assert np.array_equal(normal[0], low[0]) and np.array_equal(normal[1], low[1])
    assert normal[2] == [] and "ggml threadpool priority low" in low[2]


@linux_only
def test_low_priority_lowers_the_engine_thread_and_leaves_the_main_thread(smollm_path):
    main_tid = threading.get_native_id()
    main_nice = os.getpriority(os.PRIO_PROCESS, main_tid)
    main_policy = os.sched_getscheduler(main_tid)
    _, _, applied, policy, nice = _in_thread(lambda: _logits(smollm_path, "low"))
    assert policy == os.SCHED_BATCH            # applied by ggml itself, on the calling thread
    assert nice >= ComputeThreads.LINUX_NICE and f"nice {nice}" in applied
    # the thread that stands for the UI was not touched
    assert os.getpriority(os.PRIO_PROCESS, main_tid) == main_nice
    assert os.sched_getscheduler(main_tid) == main_policy


def test_a_library_without_the_threadpool_api_is_left_alone(caplog):
    from native.library import bindings
    threads = ComputeThreads(bindings(), None, 2, Path("/nonexistent/folder"))
    assert threads.applied == []
    assert "normal priority" in caplog.text
    threads.close()   # nothing to free
