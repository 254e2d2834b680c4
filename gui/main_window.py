"""The main window: conversations, chat, prompt, model bar and status bar.

The window never calls the model: commands go to the engine thread through
:class:`~gui.bridge.EngineBridge` and results come back as queued signals.  What the
window does with the checkpoint store (listing, the browser, drag-and-drop import)
is in gui.store_actions; the widgets themselves live in their own modules.
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

from PySide6.QtCore import QSize, Qt, QTimer, Signal, Slot
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (
    QFileDialog,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QMainWindow,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from engine.checkpoints.format import KIND_AUTOSAVE, KIND_NAMES
from engine.checkpoints.store import Store
from engine.commands import Action
from engine.events import FINISH_ERROR, ConversationSnapshot, GenerationSummary, ModelInfo, ModelOptions
from engine.models import default_model_path
from gui.branch_actions import BranchActions
from gui.bridge import EngineBridge
from gui.browser import CheckpointBrowser
from gui.chat_state import ChatState
from gui.chat_view import ChatView, MessageEditor, OfferBar, PromptEdit
from gui.conversations import PAUSED_MARK, ConversationList
from gui.files import file_size_text
from gui.settings import AppSettings
from gui.store_actions import StoreActions

log = logging.getLogger("gui")

CLOSE_WAIT_MS = 15000   # bounded wait for the exit checkpoint when closing mid-answer

class MainWindow(StoreActions, BranchActions, QMainWindow):
    """Checkpoint Chat's main window.

    Signals:
        imports_finished(list): FileCheck results of a drop or File > Open Checkpoint.
        validation_finished(object): FileCheck of a browser Validate.
        message_shown(str, str): title and text of every message shown to the user.
        store_listed(): the conversation list and browser were refreshed from the store.
        conversation_deleted(UUID): a conversation and the files only it needed are gone.
    """

    imports_finished = Signal(list)
    validation_finished = Signal(object)
    message_shown = Signal(str, str)
    store_listed = Signal()
    conversation_deleted = Signal(object)

    def __init__(self, settings: AppSettings | None = None) -> None:
        super().__init__()
        self.settings = settings or AppSettings()
        self.store = Store(self.settings.checkpoint_folder())
        self.bridge = EngineBridge(self.store, self)
        self.worker = self.bridge.worker
        self._apply_autosave_settings()
        self.snapshots: dict[uuid.UUID, ConversationSnapshot] = {}
        self.last_summary: GenerationSummary | None = None
        self.pause_clicked_at: float | None = None
        self._pause_clicked_for: uuid.UUID | None = None   # the conversation that Pause was for
        self.pause_latency_s: float | None = None
        self.resume_offer: QMessageBox | None = None
        self.crash_offer: QMessageBox | None = None
        self.message_editor: MessageEditor | None = None
        self._unopened: dict[uuid.UUID, Path] = {}   # shown from its file; the engine lacks it
        #: the shown conversation, the answers running or asked for, closing (gui.chat_state)
        self.state = ChatState(unopened=self._unopened)
        self._pending_fork: uuid.UUID | None = None  # selected when its snapshot comes
        #: the conversations whose autosaves fail (a full or failing disk), with the last
        #: reason: said once in a box while any fail (one full disk fails them all: the
        #: server's conversations too), then only in each one's status line, until one of
        #: its checkpoints is saved again
        self._autosave_failing: dict[uuid.UUID | None, str] = {}
        self._open_after_load: Path | None = None    # "Load <model>": open this once it is loaded
        self._close_done = False
        self._engine_stopped = False
        self.browser: CheckpointBrowser | None = None
        self.setWindowTitle("Checkpoint Chat")
        self.setAcceptDrops(True)
        self.resize(QSize(1100, 720))
        self._build_widgets()
        self._build_menus()
        self._connect_bridge()
        self._update_buttons()
        from gui.local_server import LocalServerSwitch
        self.local_server = LocalServerSwitch(self)   # Settings › Local server, on this worker

    # -- the chat state (gui.chat_state), under the names the mixins use ----------------------------
    @property
    def current(self) -> uuid.UUID | None:
        return self.state.current

    @current.setter
    def current(self, conv_id: uuid.UUID | None) -> None:
        self.state.current = conv_id

    @property
    def _closing(self) -> bool:
        return self.state.closing

    @property
    def running(self) -> uuid.UUID | None:
        """The shown conversation while it has an answer asked for or running, else None."""
        return self.current if self.state.shown_answering else None

    # -- construction ---------------------------------------------------------------------------
    def _build_widgets(self) -> None:
        splitter = QSplitter(self)
        splitter.addWidget(self._build_list_pane())
        splitter.addWidget(self._build_chat_pane())
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([220, 880])
        self.setCentralWidget(splitter)
        self._build_status_bar()
        # keyboard order: list -> chat -> prompt -> buttons
        QWidget.setTabOrder(self.conversation_list, self.chat_view)
        QWidget.setTabOrder(self.chat_view, self.prompt_edit)
        QWidget.setTabOrder(self.prompt_edit, self.send_button)
        QWidget.setTabOrder(self.send_button, self.pause_button)
        QWidget.setTabOrder(self.pause_button, self.resume_button)
        QWidget.setTabOrder(self.resume_button, self.regenerate_button)

    def _build_list_pane(self) -> QWidget:
        self.conversation_list = ConversationList(self)
        self.conversation_list.currentItemChanged.connect(self._on_list_current_changed)
        self.conversation_list.new_requested.connect(self.new_conversation)
        self.conversation_list.rename_requested.connect(self.rename_conversation)
        self.conversation_list.delete_requested.connect(self.delete_conversation)
        new_button = QPushButton("New conversation", self)
        new_button.setObjectName("newButton")
        new_button.clicked.connect(self.new_conversation)
        left = QWidget(self)
        lv = QVBoxLayout(left)
        lv.setContentsMargins(0, 0, 0, 0)
        lv.addWidget(new_button)
        lv.addWidget(self.conversation_list, 1)
        return left

    def _build_chat_pane(self) -> QWidget:
        self.model_status = QLabel("Loading model…", self)
        self.model_status.setObjectName("modelStatus")
        self.model_status.setAccessibleName("Model status")
        self.model_progress = QProgressBar(self)
        self.model_progress.setObjectName("modelProgress")
        self.model_progress.setAccessibleName("Model loading progress")
        self.model_progress.setRange(0, 100)
        self.model_progress.setMaximumWidth(240)
        model_bar = QHBoxLayout()
        model_bar.addWidget(self.model_status, 1)
        model_bar.addWidget(self.model_progress)

        self.chat_view = ChatView(self)
        self.chat_view.edit_requested.connect(self._on_chat_view_edit_requested)
        self.chat_view.fork_requested.connect(self._on_chat_view_fork_requested)
        self.chat_view.continue_requested.connect(self._on_chat_view_continue_requested)
        self.chat_view.alternative_requested.connect(self._on_chat_view_alternative_requested)
        self.offer_bar = OfferBar(self)
        self.prompt_edit = PromptEdit(self)
        self.prompt_edit.submitted.connect(self.send)
        self.send_button = self._button("Send", "sendButton", "Send message", self.send)
        self.pause_button = self._button("Pause", "pauseButton", "Pause generation", self.pause)
        self.resume_button = self._button("Resume", "resumeButton", "Resume paused answer", self.resume)
        self.regenerate_button = self._button("Regenerate", "regenerateButton", "Regenerate answer",
                                              self.regenerate)
        self.pause_button.setToolTip("Pause (Esc): stops within one token and saves a checkpoint")
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        for b in (self.regenerate_button, self.resume_button, self.pause_button, self.send_button):
            buttons.addWidget(b)
        right = QWidget(self)
        rv = QVBoxLayout(right)
        rv.setContentsMargins(0, 0, 0, 0)
        rv.addLayout(model_bar)
        rv.addWidget(self.chat_view, 1)
        rv.addWidget(self.offer_bar)
        rv.addWidget(self.prompt_edit)
        rv.addLayout(buttons)
        return right

    def _build_status_bar(self) -> None:
        sb = self.statusBar()
        self.speed_label = QLabel("", self)
        self.speed_label.setObjectName("tokensPerSecond")
        self.context_usage = QProgressBar(self)
        self.context_usage.setObjectName("contextUsage")
        self.context_usage.setAccessibleName("Context used")
        self.context_usage.setMaximumWidth(220)
        self.context_usage.setFormat("%v / %m tokens")
        self.context_usage.setRange(0, 1)
        self.context_usage.setValue(0)
        self.save_progress = QProgressBar(self)
        self.save_progress.setObjectName("saveProgress")
        self.save_progress.setRange(0, 0)      # busy indicator: llama.cpp gives no save progress
        self.save_progress.setMaximumWidth(90)
        self.save_progress.hide()
        self.checkpoint_label = QLabel("No checkpoint yet", self)
        self.checkpoint_label.setObjectName("lastCheckpoint")
        sb.addWidget(self.speed_label)
        sb.addPermanentWidget(self.save_progress)
        sb.addPermanentWidget(self.checkpoint_label)
        sb.addPermanentWidget(self.context_usage)

    def _button(self, text: str, name: str, accessible: str, slot) -> QPushButton:
        b = QPushButton(text, self)
        b.setObjectName(name)
        b.setAccessibleName(accessible)
        b.clicked.connect(slot)
        return b

    def _build_menus(self) -> None:
        def action(menu, text, slot, shortcut=None) -> QAction:
            a = QAction(text, self)
            if shortcut:
                a.setShortcut(QKeySequence(shortcut))
            a.triggered.connect(slot)
            menu.addAction(a)
            return a

        m = self.menuBar().addMenu("&File")
        action(m, "&New Conversation", self.new_conversation, "Ctrl+N")
        action(m, "Open &Model…", self.open_model_dialog)
        self.recent_menu = m.addMenu("Recent Models")
        self.recent_menu.aboutToShow.connect(self._fill_recent_menu)
        action(m, "&Open Checkpoint…", self.open_checkpoint_dialog, "Ctrl+O")
        action(m, "&Checkpoints…", self.show_browser, "Ctrl+B")
        m.addSeparator()
        action(m, "&Settings…", self.open_settings, "Ctrl+,")
        m.addSeparator()
        action(m, "&Quit", self.close, "Ctrl+Q")
        c = self.menuBar().addMenu("&Conversation")
        action(c, "&Send", self.send)
        self.pause_action = action(c, "&Pause", self.pause, "Esc")
        action(c, "&Resume", self.resume, "Ctrl+R")
        action(c, "Re&generate", self.regenerate, "Ctrl+Shift+R")
        action(c, "Con&tinue the Answer", self.continue_answer)
        action(c, "Edit the S&ystem Prompt…", self._edit_system_prompt_dialog)
        c.addSeparator()
        action(c, "Re&name…", lambda: self.current and self.rename_conversation(self.current), "F2")
        action(c, "&Delete…", lambda: self.current and self.delete_conversation(self.current))
        h = self.menuBar().addMenu("&Help")
        action(h, "&About", self._about)

    def _connect_bridge(self) -> None:
        b = self.bridge
        b.model_loading.connect(self._on_bridge_model_loading)
        b.conversations_left.connect(self._on_bridge_conversations_left)
        b.model_loaded.connect(self._on_bridge_model_loaded)
        b.model_failed.connect(self._on_bridge_model_failed)
        b.conversation_changed.connect(self._on_bridge_conversation_changed)
        b.generation_started.connect(self._on_bridge_generation_started)
        b.prefill_progressed.connect(self._on_bridge_prefill_progressed)
        b.tokens_generated.connect(self._on_bridge_tokens_generated)
        b.progress_updated.connect(self._on_bridge_progress_updated)
        b.generation_finished.connect(self._on_bridge_generation_finished)
        b.checkpoint_saving.connect(self._on_bridge_checkpoint_saving)
        b.checkpoint_saved.connect(self._on_bridge_checkpoint_saved)
        b.conversation_deleted.connect(self._on_bridge_conversation_deleted)
        b.conversation_activated.connect(self._on_bridge_conversation_activated)
        b.checkpoint_exported.connect(self._on_bridge_checkpoint_exported)
        b.notice_posted.connect(self.show_message)
        b.context_full.connect(self._on_bridge_context_full)
        b.engine_failed.connect(self._on_bridge_engine_failed)
        b.engine_stopped.connect(self._on_bridge_engine_stopped)

    def _apply_autosave_settings(self) -> None:
        self.worker.autosave_every = max(0, self.settings.autosave_every)
        self.worker.autosave_budget = max(1, self.settings.autosave_budget_mb) * (1 << 20)

    # -- start --------------------------------------------------------------------------------------
    def start(self, model: Path | None = None) -> None:
        """Open a fresh conversation, start the engine thread, load the model (``model``,
        else the settings'), list the store.

        The window draws its first conversation before the engine thread starts: that
        thread's first moments (importing the native layer) hold the GIL, and the first
        layout of a document in a process is the slowest (~18 ms measured together).
        """
        self.new_conversation()
        self.bridge.start()
        self.load_model(model)
        self.refresh_store()
        self.prompt_edit.setFocus()
        self.local_server.apply()

    def model_options(self) -> ModelOptions:
        s = self.settings
        path = Path(s.model_path) if s.model_path else default_model_path()
        return ModelOptions(path=path, n_ctx=s.n_ctx, n_threads=s.n_threads,
                            n_gpu_layers=s.n_gpu_layers, llama_lib=s.llama_lib or None,
                            rpc_servers=s.rpc_servers.strip(), sequences=max(1, s.sequences))

    def load_model(self, path: Path | None = None) -> None:
        try:
            options = self.model_options()
        except Exception as exc:  # noqa: BLE001 - the default model may be missing
            self._on_bridge_model_failed(str(exc))
            return
        if path is not None:
            from dataclasses import replace
            options = replace(options, path=Path(path))
        self.model_status.setText(f"Loading {options.path.name}…")
        self.model_progress.setValue(0)
        self.model_progress.show()
        self.bridge.load_model(options)

    # -- user actions -------------------------------------------------------------------------------
    def _model_sampling(self):
        info = self.bridge.model_info
        return info.sampling_defaults if info is not None else None

    @Slot()
    def new_conversation(self) -> None:
        if self._closing:
            return
        if self._shows_an_empty_conversation():   # Ctrl+N again: one empty one is enough
            self.prompt_edit.setFocus()
            return
        conv_id = self.worker.new_conversation(system_prompt=self.settings.system_prompt,
                                               sampler=self.settings.sampler(self._model_sampling()))
        self.current = conv_id
        self.offer_bar.withdraw()
        self.conversation_list.upsert(conv_id, "New conversation", top=True)
        self.conversation_list.select(conv_id)
        self.chat_view.set_transcript([])
        self._update_context_usage(0, self.bridge.model_info.n_ctx if self.bridge.model_info else 0)
        self._update_buttons()

    def _shows_an_empty_conversation(self) -> bool:
        """The conversation shown is one the engine has open and nothing was said in yet (no
        answer asked for either): New conversation keeps it (each Ctrl+N added another empty
        one to the list, under Wine), and it takes the settings' sampler when they change."""
        snap = self.snapshots.get(self.current) if self.current else None
        return (self.current is not None and self.current not in self._unopened
                and not self.state.shown_opening and not self.state.shown_answering
                and (snap is None or not snap.transcript))

    @Slot()
    def send(self) -> None:
        text = self.prompt_edit.toPlainText().strip()
        if self.current in self._unopened and text:
            self.statusBar().showMessage("This conversation is not open: choose above the message box "
                                         "how to go on with it.", 8000)
            return
        if self.state.shown_opening and text:   # (the message stays in the box)
            self.statusBar().showMessage("The conversation is still opening: send once it is open.", 8000)
            return
        if self.state.switching_model and text:
            self.statusBar().showMessage("Another model is loading: send once it is loaded.", 8000)
            return
        if not text or (self.current is not None and not self.state.can_send()) or self._closing:
            return
        if self.current is None:
            self.new_conversation()
        self.prompt_edit.clear()
        self.offer_bar.withdraw("context full")
        snap = self.snapshots.get(self.current)
        if snap is None or snap.title in ("", "New conversation"):
            self.conversation_list.upsert(self.current, _title_from(text))
        self.chat_view.begin_answer(text)
        self.state.asked(self.current)
        self.worker.send(self.current, text, self.settings.n_predict)
        self._update_buttons()

    @Slot()
    def pause(self) -> None:
        """Pause the shown conversation's answer (the others go on)."""
        if not self.state.can_pause():
            return
        self.pause_clicked_at = time.perf_counter()
        self._pause_clicked_for = self.current
        self.bridge.pause(self.current)

    @Slot()
    def resume(self) -> None:
        snap = self.snapshots.get(self.current) if self.current else None
        if not self.state.can_resume(snap):
            return
        self.chat_view.begin_answer(None)
        self.state.asked(self.current)
        self.worker.resume(self.current)
        self._update_buttons()

    @Slot()
    def regenerate(self) -> None:
        snap = self.snapshots.get(self.current) if self.current else None
        if not self.state.can_send() or snap is None or not snap.transcript:
            return
        if self.chat_view.messages and self.chat_view.messages[-1].role == "assistant":
            self.chat_view.messages.pop()
        self.chat_view.begin_answer(None)
        self.state.asked(self.current)
        self.worker.regenerate(self.current, self.settings.n_predict)
        self._update_buttons()

    def rename_conversation(self, conv_id: uuid.UUID) -> None:
        item = self.conversation_list.item_for(conv_id)
        old = item.text().removeprefix(PAUSED_MARK) if item else ""
        title, ok = QInputDialog.getText(self, "Rename conversation", "Title:", text=old)
        if ok and title.strip():
            self._rename(conv_id, title.strip())

    def _rename(self, conv_id: uuid.UUID, title: str) -> None:
        if conv_id not in self.snapshots:
            path = self.conversation_list.path_of(conv_id)
            if path is None:
                return
            problem = self.conversation_list.problem_of(conv_id)
            if problem:   # the engine cannot open it to write the new title
                self.show_message("Rename", f"This conversation cannot be renamed here: {problem}")
                return
            self.worker.open_checkpoint(path)   # the queue keeps the order: open, then rename
        self.worker.rename(conv_id, title)
        self.conversation_list.upsert(conv_id, title)

    def delete_conversation(self, conv_id: uuid.UUID) -> None:
        if self.state.is_answering(conv_id):
            return
        answer = QMessageBox.question(self, "Delete conversation",
                                      "Delete this conversation and its checkpoint files?")
        if answer == QMessageBox.StandardButton.Yes:
            self._delete(conv_id)

    def _delete(self, conv_id: uuid.UUID) -> None:
        # the engine thread forgets it and deletes every file only it needs (its whole
        # history: heads, chains, autosaves), then reports conversation_deleted
        self.snapshots.pop(conv_id, None)
        self._unopened.pop(conv_id, None)
        self.worker.delete_conversation(conv_id)
        self.conversation_list.remove(conv_id)
        if self.current == conv_id:
            self.current = None
            self.new_conversation()

    # -- model ------------------------------------------------------------------------------------
    def open_model_dialog(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open model", str(Path.home()), "GGUF models (*.gguf)")
        if path:
            self.switch_model(Path(path))

    def switch_model(self, path: Path) -> None:
        if not self.state.idle:
            self.show_message("Model", "Pause the answer before switching models.")
            return
        self.settings.model_path = str(path)
        self.settings.add_recent_model(str(path))
        self.state.switching_model = True
        self.load_model(path)
        self._update_buttons()

    def _fill_recent_menu(self) -> None:
        self.recent_menu.clear()
        for p in self.settings.recent_models():
            self.recent_menu.addAction(Path(p).name, lambda p=p: self.switch_model(Path(p)))
        if self.recent_menu.isEmpty():
            self.recent_menu.addAction("(none)").setEnabled(False)

    def open_settings(self) -> None:
        from gui.settings_dialog import SettingsDialog
        dialog = SettingsDialog(self.settings, self.bridge.model_info, self)
        if dialog.exec():
            self._apply_autosave_settings()
            self._sampler_to_the_empty_conversation(self.bridge.model_info)
            self.local_server.apply()
            if dialog.model_changed and self.state.idle:
                self.load_model()

    def _sampler_to_the_empty_conversation(self, info: ModelInfo | None) -> None:
        """The conversation shown, while nothing was said in it, answers with the sampler the
        settings give now (the model's defaults where the user set none): one opened before
        the model was known, or before the user changed the settings (its seed, say)."""
        if info is not None and self._shows_an_empty_conversation():
            self.worker.set_sampler(self.current, self.settings.sampler(info.sampling_defaults))

    def _about(self) -> None:
        QMessageBox.about(self, "Checkpoint Chat", about_text(self.bridge.model_info))

    # -- messages ---------------------------------------------------------------------------------
    def show_message(self, title: str, text: str, *, error: bool = False) -> QMessageBox:
        """The one way the app tells the user something: a non-modal box, also a signal."""
        log.log(logging.WARNING if error else logging.INFO, "%s: %s", title, text)
        box = QMessageBox(QMessageBox.Icon.Warning if error else QMessageBox.Icon.Information,
                          title, text, QMessageBox.StandardButton.Ok, self)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        box.open()
        self.message_shown.emit(title, text)
        return box

    def show_error(self, title: str, text: str) -> QMessageBox:
        return self.show_message(title, text, error=True)

    def show_offer(self, conv_id: uuid.UUID, kind: str, title: str, text: str, actions=()) -> None:
        """Tell the user something about one conversation where it is shown, with what can
        be done about it (the offer bar: (label, callable) buttons); also message_shown."""
        log.info("%s: %s", title, text)
        self.offer_bar.offer(conv_id, kind, text, list(actions))
        self.message_shown.emit(title, text)

    def report_crash(self, reports, kept: list[Path], autosave: Path | None) -> None:
        """Tell the user how the previous run ended; offer its newest autosave."""
        trace = f"\n\nThe trace is kept in {kept[-1]}." if kept else ""
        last = reports[-1]
        what = last.what if last.killed else f"{last.what} ({last.excerpt})"
        if autosave is None:
            if not reports[-1].killed:   # a kill with nothing autosaved has nothing to offer
                self.show_error("Checkpoint Chat stopped unexpectedly",
                                f"The previous run {what}; no autosave was found." + trace)
            return
        box = QMessageBox(QMessageBox.Icon.Warning, "Checkpoint Chat stopped unexpectedly",
                          f"The previous run {what}. Its answer in progress was autosaved: "
                          f"open it ({autosave.name}) to resume?" + trace,
                          QMessageBox.StandardButton.NoButton, self)
        resume = box.addButton("Open", QMessageBox.ButtonRole.AcceptRole)
        box.addButton("Not now", QMessageBox.ButtonRole.RejectRole)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        box.buttonClicked.connect(lambda b: b is resume and self.open_checkpoint(autosave))
        box.open()
        self.crash_offer = box

    # -- engine events ---------------------------------------------------------------------------
    @Slot(float)
    def _on_bridge_model_loading(self, fraction: float) -> None:
        self.model_progress.setValue(int(fraction * 100))

    @Slot(object)
    def _on_bridge_conversations_left(self, left) -> None:
        """Another model loaded: these conversations are stored ones of the model that made
        them now (listed dimmed; the one shown gets its offer once the model is known)."""
        for c in left:
            self.snapshots.pop(c.id, None)
            self._unopened[c.id] = c.path
            self.conversation_list.upsert(c.id, c.title, path=c.path, header=c.header, model_name=c.model_name)

    @Slot(object)
    def _on_bridge_model_loaded(self, info: ModelInfo) -> None:
        self.model_progress.hide()
        self.state.switching_model = False
        self.chat_view.set_thinking_format(info.thinking)
        self.model_status.setText(f"<b>{info.name}</b> · {info.backend} · context {info.n_ctx:,} tokens")
        self.model_status.setToolTip(f"{info.path}\nllama.cpp {info.library_version}: {info.library_path}")
        snap = self.snapshots.get(self.current) if self.current else None
        self._update_context_usage(snap.n_tokens if snap else 0, info.n_ctx)
        self._sampler_to_the_empty_conversation(info)   # opened before the model was known
        self.conversation_list.set_target(info.target)
        if self._open_after_load is not None:
            path, self._open_after_load = self._open_after_load, None
            self.open_checkpoint(path)
        elif self.current in self._unopened:
            self._open_listed(self.current)   # it may fit the model loaded now
        self.refresh_store()
        self._update_buttons()   # (Send was off while another model loaded)

    @Slot(str)
    def _on_bridge_model_failed(self, message: str) -> None:
        self.model_progress.hide()
        self.state.switching_model = False
        self.model_status.setText("No model loaded — File › Open Model…")
        self.state.ended_all()
        if self._open_after_load is not None:
            self._open_after_load = None
            if self.current in self._unopened:   # its offer again, as it was before the click
                self.show_unopened(self.current, self._unopened[self.current], failure=message)
        self._update_buttons()

    @Slot(object)
    def _on_bridge_conversation_changed(self, snap: ConversationSnapshot) -> None:
        self.snapshots[snap.id] = snap
        self._unopened.pop(snap.id, None)
        if self.state.opening is not None and self.state.opening[0] == snap.id:
            self.state.opening = None
            self._update_buttons()   # it can be sent in now
        fork = snap.id == self._pending_fork
        title = snap.title
        if title == "New conversation" and snap.id in self.state.answering:
            # created, then sent in at once: this snapshot was taken before the message,
            # whose title the list shows already
            title = self.conversation_list.title_of(snap.id) or title
        self.conversation_list.upsert(snap.id, title, path=snap.checkpoint, paused=snap.paused,
                                      opened=True, top=fork)
        if fork:
            self._pending_fork = None
            self.current = snap.id
            self.conversation_list.select(snap.id)
            self.offer_bar.withdraw()
        if snap.id == self.current and not self.state.is_answering(snap.id):
            if self.offer_bar.conversation == snap.id:
                self.offer_bar.withdraw("unopened")
            self._show_snapshot(snap)
        self._update_buttons()

    @Slot(object)
    def _on_bridge_generation_started(self, snap: ConversationSnapshot) -> None:
        self.snapshots[snap.id] = snap
        self.state.started(snap.id, snap.transcript)
        self.conversation_list.upsert(snap.id, snap.title)
        if snap.id == self.current:
            self._follow_started_answer(snap)
            self._update_context_usage(snap.n_tokens, snap.n_ctx)
        # the engine is busy whoever asked (a local server client too): the speed says so;
        # the context meter stays the shown conversation's
        self.speed_label.setText("Reading the prompt…" if snap.id == self.current
                                 else f"Answering “{snap.title}”…")
        self._update_buttons()

    @Slot(object, int, int)
    def _on_bridge_prefill_progressed(self, conv_id, done: int, total: int) -> None:
        if done < total and conv_id == self.current:
            self.speed_label.setText(f"Reading the prompt… {done:,} / {total:,} tokens")

    @Slot(object, str)
    def _on_bridge_tokens_generated(self, conv_id, text: str) -> None:
        self.state.text(conv_id, text)
        if conv_id == self.current:
            if self.speed_label.text().startswith("Reading"):
                self.speed_label.setText("Generating…")
            self.chat_view.append_text(text)

    @Slot(object, int, int, float)
    def _on_bridge_progress_updated(self, conv_id, n_tokens: int, n_generated: int,
                                    tokens_per_s: float) -> None:
        """While an answer streams: the context meter and the speed, live."""
        if conv_id != self.current:
            return
        self._update_context_usage(n_tokens, self.context_usage.maximum())
        if n_generated > 1 and tokens_per_s > 0:
            self.speed_label.setText(f"Generating… {tokens_per_s:.1f} tokens/s · {n_generated} tokens")

    @Slot(object)
    def _on_bridge_generation_finished(self, summary: GenerationSummary) -> None:
        self.last_summary = summary
        if self.pause_clicked_at is not None and summary.conversation_id == self._pause_clicked_for:
            self.pause_latency_s = time.perf_counter() - self.pause_clicked_at
            self.pause_clicked_at = None
        self.state.ended(summary.conversation_id)
        paused = summary.finish_reason == "paused"
        if summary.finish_reason == FINISH_ERROR:
            if summary.conversation_id == self.current:
                self.chat_view.finish_answer(complete=False, note="Stopped by an error")
            self._update_buttons()
            return
        if summary.conversation_id == self.current or not self.state.shown_answering:
            self.speed_label.setText(f"{summary.tokens_per_s:.1f} tokens/s · {summary.n_generated} tokens"
                                     + (f" · {summary.n_reused_tokens:,} prompt tokens reused"
                                        if summary.n_reused_tokens else ""))
        if summary.conversation_id == self.current:
            if paused and summary.n_generated == 0 and not self.chat_view.answer_text():
                note = "Paused before the first token · saving checkpoint…"
            else:
                note = "Paused · saving checkpoint…" if paused else ""
            self.chat_view.finish_answer(complete=not paused, note=note)
        self._update_buttons()

    @Slot(object, int)
    def _on_bridge_checkpoint_saving(self, conv_id, kind: int) -> None:
        if conv_id != self.current and not self._closing:
            return   # another conversation's answer, in the background
        self.save_progress.show()
        self.checkpoint_label.setText(f"Saving {KIND_NAMES.get(kind, '')} checkpoint…")

    @Slot(object, str, int, float, int)
    def _on_bridge_checkpoint_saved(self, snap: ConversationSnapshot, path: str, size: int,
                                    seconds: float, kind: int) -> None:
        self.save_progress.hide()
        self._autosave_failing.pop(snap.id, None)
        stamp = time.strftime("%H:%M:%S")
        if snap.id == self.current:
            self.checkpoint_label.setText(f"Checkpoint {stamp} · {file_size_text(size)}"
                                          + (" (autosave)" if kind == KIND_AUTOSAVE else ""))
            self.checkpoint_label.setToolTip(f"{path}\nwritten in {seconds * 1000:.0f} ms")
        if kind == KIND_AUTOSAVE:
            return   # the conversation's own file is unchanged; nothing else to update
        self.snapshots[snap.id] = snap
        self.conversation_list.upsert(snap.id, snap.title, path=Path(path), paused=snap.paused, opened=True)
        if snap.id == self.current and not self.state.is_answering(snap.id):
            self._update_context_usage(snap.n_tokens, snap.n_ctx)
            self._follow_saved(snap)
            if snap.paused:
                self.chat_view.set_note(f"Paused · saved {file_size_text(size)} at {stamp} — Resume continues it")
        self._update_buttons()
        if self.browser is not None and self.browser.isVisible():
            self.refresh_store()

    @Slot(object)
    def _on_bridge_conversation_deleted(self, conv_id) -> None:
        self._autosave_failing.pop(conv_id, None)
        self.conversation_deleted.emit(conv_id)
        self.refresh_store()

    @Slot(object, bool, int, float)
    def _on_bridge_conversation_activated(self, conv_id, resident: bool, n_restored: int,
                                          seconds: float) -> None:
        """A switch: say whether the conversation was still in the cache."""
        if conv_id != self.current:
            return
        if resident:
            text = "Resident in the cache: switched without restoring anything"
        elif n_restored:
            text = f"Restored {n_restored:,} tokens from its checkpoint in {seconds * 1000:.0f} ms"
        else:
            text = "In the cache"
        self.statusBar().showMessage(text, 6000)

    @Slot(object, str, object)
    def _on_bridge_engine_failed(self, action: Action, message: str, conv_id: uuid.UUID | None) -> None:
        """What failed decides what the window does (the action's kind, not its wording);
        a failure of a conversation in the background is said as that conversation's."""
        elsewhere = conv_id is not None and conv_id != self.current
        if not elsewhere:
            self.save_progress.hide()
        self._update_buttons()
        if action is Action.FORK:
            self._pending_fork = None
        if action is Action.AUTOSAVE:
            # every autosave interval would open another box: once, then the status line
            # (each conversation's own, once it is shown: _show_snapshot)
            if not elsewhere:
                self.checkpoint_label.setText(f"Autosave failed at {time.strftime('%H:%M:%S')}")
                self.checkpoint_label.setToolTip(message)
            said = bool(self._autosave_failing)
            self._autosave_failing[conv_id] = message
            if said:
                log.warning("Could not autosave: %s", message)
                return
        if action is Action.CONTINUE_WITH_LOADED_MODEL and not elsewhere and self.current in self._unopened:
            self.show_unopened(self.current, self._unopened[self.current], failure=message)
            return
        if action is Action.OPEN_CHECKPOINT and self.state.opening is not None \
                and conv_id in (None, self.state.opening[0]):
            # (the failure of an earlier open of another conversation leaves this one opening)
            opened_as, path = self.state.opening
            self.state.opening = None
            self._update_buttons()
            if opened_as == self.current:
                self.show_unopened(opened_as, path, failure=message)   # said where it was asked for
                return
        if elsewhere:
            snap = self.snapshots.get(conv_id)
            message = f"In the conversation “{snap.title if snap else conv_id}”: {message}"
        self.show_error(f"Could not {action}", message)

    @Slot()
    def _on_bridge_engine_stopped(self) -> None:
        self._engine_stopped = True
        if self._closing:
            self._finish_close()

    # -- display helpers ----------------------------------------------------------------------------
    def _show_snapshot(self, snap: ConversationSnapshot) -> None:
        note = ""
        if snap.paused and snap.checkpoint_size:
            note = f"Paused · saved {file_size_text(snap.checkpoint_size)} — Resume continues it"
        self.chat_view.set_transcript(snap.transcript, paused=snap.paused, note=note,
                                      alternatives=snap.alternatives)
        self._update_context_usage(snap.n_tokens, snap.n_ctx)
        if snap.id in self._autosave_failing:
            self.checkpoint_label.setText("Autosaves are failing"
                                          + (f" · last checkpoint {file_size_text(snap.checkpoint_size)}"
                                             if snap.checkpoint is not None else ""))
            self.checkpoint_label.setToolTip(self._autosave_failing[snap.id])
        elif snap.checkpoint is not None:
            self.checkpoint_label.setText(f"Checkpoint · {file_size_text(snap.checkpoint_size)}")
            self.checkpoint_label.setToolTip(str(snap.checkpoint))
        else:
            self.checkpoint_label.setText("No checkpoint yet")
            self.checkpoint_label.setToolTip("")

    def _follow_started_answer(self, snap: ConversationSnapshot) -> None:
        """An answer started: if the engine's conversation is not what the view shows up to
        it (a new branch kept only the recent turns), show the engine's, streaming."""
        if not self.chat_view.shows(snap.transcript, answer_open=True):
            self.chat_view.set_transcript(snap.transcript)
            self.chat_view.begin_answer(None)

    def _follow_saved(self, snap: ConversationSnapshot) -> None:
        """A save after an answer (or a rename): the alternatives it brings; the whole
        transcript again only if the view shows something else."""
        if not (self.chat_view.shows(snap.transcript) and self.chat_view.set_alternatives(snap.alternatives)):
            self._show_snapshot(snap)

    def _update_context_usage(self, used: int, n_ctx: int) -> None:
        self.context_usage.setRange(0, max(1, n_ctx))
        self.context_usage.setValue(min(used, max(1, n_ctx)))

    def _update_buttons(self) -> None:
        """The buttons act on the shown conversation; the list stays usable while answers
        run (switching to another conversation, or sending in it, is what they allow)."""
        state = self.state
        snap = self.snapshots.get(self.current) if self.current else None
        self.send_button.setEnabled(state.can_send())
        self.pause_button.setEnabled(state.can_pause())
        self.pause_action.setEnabled(state.can_pause())
        self.resume_button.setEnabled(state.can_resume(snap))
        self.regenerate_button.setEnabled(state.can_regenerate(snap))
        self.conversation_list.set_answering(state.answering)

    def _on_list_current_changed(self, item, _previous=None) -> None:
        if item is None:
            return
        conv_id = item.data(Qt.ItemDataRole.UserRole)
        if conv_id == self.current:
            return
        self.current = conv_id
        self.offer_bar.withdraw()
        snap = self.snapshots.get(conv_id)
        streamed = self.state.streamed(conv_id)
        if streamed is not None:
            # its answer is running: what it streamed so far, then the rest as it comes
            transcript, text = streamed
            self.chat_view.set_transcript(transcript)
            self.chat_view.begin_answer(None)
            self.chat_view.append_text(text)
            self.speed_label.setText("Generating…")
            if snap is not None:
                self._update_context_usage(snap.n_tokens, snap.n_ctx)
        elif snap is not None:
            self._show_snapshot(snap)
            self.worker.show(conv_id)
        else:
            self._open_listed(conv_id)
        self._update_buttons()

    def select_conversation(self, conv_id: uuid.UUID) -> None:
        """Make ``conv_id`` the current conversation, as a click in the list would."""
        item = self.conversation_list.item_for(conv_id)
        if item is not None:
            self.conversation_list.setCurrentItem(item)

    # -- closing ------------------------------------------------------------------------------------
    def closeEvent(self, event: QCloseEvent) -> None:
        """Pause and save before exiting, with a visible notice and a bounded wait."""
        if self._close_done or self._engine_stopped or not self.worker.alive:
            if self.browser is not None:
                self.browser.close()
            event.accept()
            return
        event.ignore()
        if self._closing:
            return
        self.state.closing = True
        self.statusBar().showMessage("Saving…")
        self.save_progress.show()
        self.prompt_edit.setEnabled(False)
        self._update_buttons()
        self.local_server.stop()      # answers of its clients pause and are saved, as the window's
        self.bridge.shutdown()
        QTimer.singleShot(CLOSE_WAIT_MS, self._finish_close)

    def _finish_close(self) -> None:
        if self._close_done:
            return
        self._close_done = True
        if not self._engine_stopped:
            log.warning("the engine did not finish saving within %d ms; exiting anyway", CLOSE_WAIT_MS)
        self.close()


def about_text(info: ModelInfo | None) -> str:
    """The About box: what the app promises, and the determinism contract of the model
    loaded (README, "Several conversations at once")."""
    text = "Checkpoint Chat: generation state is never lost and never computed twice."
    if info is None:
        return text
    text += (f"\n\nllama.cpp: {info.library_version} ({info.library_path})"
             f"\nModel: {info.name} · {info.backend} · {info.sequences} conversation(s) resident at once")
    text += ("\n\nDeterminism: an answer resumed from a checkpoint is the answer it would have "
             "been without the pause, token for token. ")
    if info.sequences > 1 and info.exact_width >= info.sequences:
        text += (f"Up to {info.sequences} answers generating at once are each identical to "
                 "their run alone (measured for this model when it loaded).")
    elif info.sequences > 1 and info.exact_width == 0:
        text += ("Answers generating at once may differ from their runs alone in rare tokens: "
                 "without flash attention a sequence's sums depend on the others in the cache.")
    elif info.sequences > 1:
        text += (f"Answers generating at once are decoded {info.exact_width} to a step, the width "
                 "measured for this model when it loaded at which each stays identical to its "
                 "run alone; beyond it they take turns.")
    return text


def _title_from(text: str, limit: int = 48) -> str:
    words = " ".join(text.split())
    return words if len(words) <= limit else words[:limit - 1].rstrip() + "…"
