"""The main window's dealings with branches: edit, continue, fork, switch, context full.

A mixin of :class:`gui.main_window.MainWindow` (it uses the window's chat view, worker,
snapshots and status bar).  Every action goes to the engine thread
(engine.worker.EngineWorker: edit_message, edit_system_prompt, continue_answer, fork,
switch_branch, send_in_new_branch); what changed comes back as the usual snapshots, whose
``alternatives`` the chat view shows as ``‹ k/n ›``.
"""

from __future__ import annotations

import uuid

from PySide6.QtCore import Qt, Slot

from gui.chat_view import MessageEditor


class BranchActions:
    """Branch commands of the chat view and menus (MainWindow mixin)."""

    def _branch_ready(self) -> bool:
        """Whether the current conversation is open in the engine and nothing generates."""
        if not self.state.can_send():
            self.statusBar().showMessage("Pause the answer first.", 5000)
            return False
        return self.current is not None and self.current in self.snapshots

    def _conversation_index(self, index: int) -> int:
        """The index in the conversation's messages (no system entry) of view message ``index``."""
        messages = self.chat_view.messages
        return index - (1 if messages and messages[0].role == "system" else 0)

    @Slot(int)
    def _on_chat_view_edit_requested(self, index: int) -> None:
        if not self._branch_ready() or not 0 <= index < len(self.chat_view.messages):
            return
        message = self.chat_view.messages[index]
        if message.role == "system":
            self._edit_system_prompt_dialog()
        elif message.role == "user":
            self._open_editor(message.text, lambda text: self.edit_message(index, text))

    def _edit_system_prompt_dialog(self) -> None:
        if not self._branch_ready():
            return
        snap = self.snapshots[self.current]
        current = snap.transcript[0]["content"] if snap.transcript and \
            snap.transcript[0]["role"] == "system" else ""
        self._open_editor(current, self.edit_system_prompt, system=True)

    def _open_editor(self, text: str, accepted, *, system: bool = False) -> None:
        editor = MessageEditor(text, system=system, parent=self)
        editor.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        editor.accepted.connect(lambda: accepted(editor.text()))
        editor.open()
        self.message_editor = editor

    def edit_message(self, index: int, text: str) -> None:
        """Replace user message ``index`` (of the view) by ``text`` and answer it, as a new
        branch: the turns after it stay reachable with ‹ › on that message."""
        text = text.strip()
        messages = self.chat_view.messages
        if not text or not self._branch_ready() or not 0 <= index < len(messages) \
                or messages[index].role != "user":
            return
        self.offer_bar.withdraw()
        self.chat_view.truncate(index)
        self.chat_view.begin_answer(text)
        self.state.asked(self.current)
        self.worker.edit_message(self.current, self._conversation_index(index), text, self.settings.n_predict)
        self._update_buttons()

    def edit_system_prompt(self, text: str) -> None:
        """Start the conversation over with another system prompt, as a new branch."""
        if self._branch_ready():
            self.offer_bar.withdraw()
            self.worker.edit_system_prompt(self.current, text.strip())

    @Slot(int)
    def _on_chat_view_continue_requested(self, _index: int) -> None:
        self.continue_answer()

    @Slot()
    def continue_answer(self) -> None:
        """Generate more of the last answer, which had finished."""
        snap = self.snapshots.get(self.current) if self.current else None
        if not self._branch_ready() or snap is None or not snap.transcript \
                or snap.transcript[-1]["role"] != "assistant" or snap.paused:
            return
        self.offer_bar.withdraw()
        self.chat_view.begin_answer(None)
        self.state.asked(self.current)
        self.worker.continue_answer(self.current, self.settings.n_predict)
        self._update_buttons()

    @Slot(int)
    def _on_chat_view_fork_requested(self, index: int) -> None:
        self.fork_at(index)

    def fork_at(self, index: int) -> None:
        """A new conversation holding the messages up to view message ``index``; it is
        selected in the list as soon as the engine has it."""
        if self._branch_ready() and 0 <= index < len(self.chat_view.messages):
            self._pending_fork = self.worker.fork(self.current, self._conversation_index(index))

    @Slot(int, int)
    def _on_chat_view_alternative_requested(self, index: int, number: int) -> None:
        self.show_alternative(index, number)

    def show_alternative(self, index: int, number: int) -> None:
        """Show alternative ``number`` (1-based) of view message ``index``: its branch is
        restored (only what differs from the cache), and the view follows it."""
        if not self._branch_ready() or not 0 <= index < len(self.chat_view.messages):
            return
        alternatives = self.chat_view.messages[index].alternatives
        if alternatives is None or not 1 <= number <= alternatives.count or number == alternatives.index:
            return
        head = alternatives.heads[number - 1]
        if head is not None:   # None: the one shown, not saved yet
            self.worker.switch_branch(self.current, head)


    @Slot(object, str, str)
    def _on_bridge_context_full(self, conv_id, text: str, message: str) -> None:
        """The message did not fit: nothing was generated.  Say so, and offer a new branch
        that keeps the system prompt and the most recent turns that fit."""
        self.state.ended(conv_id)
        self.speed_label.setText("")
        if conv_id != self.current:
            self.show_message("The context is full", message)
            self._update_buttons()
            return
        snap = self.snapshots.get(conv_id)
        if snap is not None:
            self._show_snapshot(snap)        # the message shown as sent is taken back
        if not self.prompt_edit.toPlainText().strip():
            self.prompt_edit.setPlainText(text)
        self.show_offer(conv_id, "context full", "The context is full", f"Not sent: {message}",
                        [("Continue in a new branch", lambda: self.send_in_new_branch(conv_id, text))])
        self._update_buttons()

    def send_in_new_branch(self, conv_id: uuid.UUID, text: str) -> None:
        """Send ``text`` on a new branch that keeps what fits of the conversation."""
        if not self.state.can_send() or conv_id != self.current:
            return
        self.offer_bar.withdraw()
        if self.prompt_edit.toPlainText().strip() == text:
            self.prompt_edit.clear()
        self.chat_view.begin_answer(text)
        self.state.asked(conv_id)
        self.worker.send_in_new_branch(conv_id, text, self.settings.n_predict)
        self._update_buttons()

