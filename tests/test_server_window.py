"""The window's "Local server" switch: the server runs on the window's qasync loop with the
window's own engine, so a client's conversation appears in the list, the window can go
on with it, and the client can go on after the window (each turn restored, not decoded)."""

from __future__ import annotations

import threading
import uuid

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("aiohttp")


def in_thread(qtbot, fn):
    """Run a blocking client call off the UI thread (the loop it talks to runs there)."""
    out = {}

    def target():
        try:
            out["value"] = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised on the test's thread
            out["error"] = exc
    thread = threading.Thread(target=target)
    thread.start()
    qtbot.waitUntil(lambda: not thread.is_alive(), timeout=120_000)
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_clients_conversation_goes_on_in_the_window_and_back(qtbot, make_window):
    w = make_window(n_predict=12)
    assert not w.local_server.label.isVisible()
    w.settings.local_server, w.settings.local_server_port = 1, 0   # 0: any free port
    w.local_server.apply()
    qtbot.waitUntil(lambda: bool(w.local_server.url), timeout=20_000)
    url = w.local_server.url
    assert url.startswith("http://127.0.0.1:") and url in w.local_server.label.text()
    assert w.local_server.label.isVisible()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = in_thread(qtbot, lambda: client.models.list().data[0].id)
    messages = [{"role": "user", "content": "Name a fruit."}]
    first = in_thread(qtbot, lambda: client.chat.completions.create(model=model, messages=messages,
                                                                    max_tokens=12, seed=1))
    conv = uuid.UUID(first.model_extra["checkpoint_chat"]["conversation"])
    qtbot.waitUntil(lambda: conv in w.snapshots and w.snapshots[conv].checkpoint is not None, timeout=20_000)
    assert w.conversation_list.item_for(conv) is not None
    # the window still shows its own (empty) conversation: its context meter is not the client's
    assert w.current != conv and w.context_usage.value() == 0

    # the window goes on with it
    w.select_conversation(conv)
    qtbot.waitUntil(lambda: w.current == conv and w.running is None, timeout=20_000)
    with qtbot.waitSignal(w.bridge.generation_finished, timeout=120_000) as finished:
        w.prompt_edit.setPlainText("And a vegetable?")
        w.send()
    answer = finished.args[0]
    assert answer.conversation_id == conv and answer.text
    qtbot.waitUntil(lambda: len(w.snapshots[conv].transcript) == 4 and w.running is None
                    and w.snapshots[conv].transcript[-1]["content"] == answer.text, timeout=20_000)

    # and the client after the window: everything before is restored, nothing decoded again
    transcript = [{"role": m["role"], "content": m["content"]} for m in w.snapshots[conv].transcript]
    before = w.last_summary
    third = in_thread(qtbot, lambda: client.chat.completions.create(
        model=model, messages=transcript + [{"role": "user", "content": "Thanks!"}], max_tokens=8, seed=2))
    assert third.model_extra["checkpoint_chat"]["conversation"] == str(conv)
    assert third.usage.prompt_tokens_details.cached_tokens == before.n_prompt_tokens + before.n_generated

    w.settings.local_server = 0
    w.local_server.apply()
    qtbot.waitUntil(lambda: not w.local_server.url and not w.local_server.label.isVisible(), timeout=20_000)
    with pytest.raises(openai.APIConnectionError):
        client.models.list()


def test_the_settings_dialog_switches_the_local_server(qapp, app_home):
    from PySide6.QtWidgets import QCheckBox, QSpinBox

    from gui.settings import AppSettings
    from gui.settings_dialog import SettingsDialog
    settings = AppSettings()
    assert settings.local_server == 0 and settings.local_server_port == 8080
    dialog = SettingsDialog(settings, None)
    dialog.findChild(QCheckBox, "localServerSwitch").setChecked(True)
    dialog.findChild(QSpinBox, "localServerPort").setValue(8123)
    dialog.accept()
    assert (settings.local_server, settings.local_server_port) == (1, 8123)
    assert not dialog.model_changed
