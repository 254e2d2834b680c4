"""The main window's dealings with the checkpoint store: listing, browser, import, export.

A mixin of :class:`gui.main_window.MainWindow` (it uses the window's store, bridge,
conversation list and signals).  All file work runs on executor threads (gui.tasks);
results come back to the UI thread as the awaited values of coroutines on the qasync
loop.  Importing is engine.checkpoints.transfer's (dropped or opened files are verified
in full, linked up and copied into the store before anything is restored from them;
the originals are never touched); deleting is engine.checkpoints.graph's (nothing a
head needs goes); exporting a chain compacts it on the engine thread.

Opening a stored conversation asks the engine to restore its head, unless the list
already knows that head cannot fit the loaded model (made with another model, another
context): then, as when a restore fails, the window shows the conversation's transcript
from the file's metadata and says why, in the window, with what can be done: load the
model that made it and open it, or continue it with the loaded model as a new branch.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from PySide6.QtCore import Qt, QUrl, Slot
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import QFileDialog, QInputDialog, QMessageBox

from engine.checkpoints import graph
from engine.checkpoints.compat import made_with
from engine.checkpoints.format import read_header, read_metadata
from engine.checkpoints.transfer import (
    MISSING_PARENT,
    FileCheck,
    chain_paths,
    check_file,
    import_files,
    import_summary,
)
from engine.conversation import transcript_of
from engine.errors import CheckpointError, IncompatibleModel
from gui.browser import CheckpointBrowser, list_rows
from gui.conversations import stored_conversations
from gui.files import local_checkpoint_paths
from gui.tasks import in_thread, spawn, thread_safe


class StoreActions:
    """Store listing, the checkpoint browser, import by drop or dialog (MainWindow mixin)."""

    browser: CheckpointBrowser | None

    # -- store: listing, browser, import --------------------------------------------------------------
    def refresh_store(self) -> None:
        spawn(self._refresh_store())

    async def _refresh_store(self) -> None:
        started = time.perf_counter()
        target = self._target()
        convs = await in_thread(stored_conversations, self.store)
        rows = await in_thread(list_rows, self.store, target) if self.browser is not None else None
        self.conversation_list.set_target(target)
        for c in convs:
            if c.id not in self.snapshots:
                self.conversation_list.upsert(c.id, c.title, path=c.path, paused=c.paused,
                                              header=c.header, model_name=c.model_name)
        if rows is not None:
            self.browser.set_rows(rows, target, time.perf_counter() - started)
        self.store_listed.emit()

    def _target(self):
        """What checkpoints must fit: the loaded model and context (compat's description)."""
        info = self.bridge.model_info
        return info.target if info is not None else None

    def show_browser(self) -> CheckpointBrowser:
        if self.browser is None:
            self.browser = CheckpointBrowser(self)
            self.browser.resume_requested.connect(self.open_checkpoint)
            self.browser.validate_requested.connect(self.validate_checkpoint)
            self.browser.rename_requested.connect(self._browser_rename)
            self.browser.delete_requested.connect(self._browser_delete)
            self.browser.export_requested.connect(self._browser_export)
            self.browser.reveal_requested.connect(
                lambda p: QDesktopServices.openUrl(QUrl.fromLocalFile(str(Path(p).parent))))
            self.browser.refresh_requested.connect(self.refresh_store)
            self.browser.files_dropped.connect(self.import_files)
        self.browser.show()
        self.browser.raise_()
        self.refresh_store()
        return self.browser

    def open_checkpoint(self, path: Path) -> None:
        """Restore a checkpoint from the store and show its conversation."""
        if self.state.is_answering(self.current):
            self.show_message("Checkpoint", "Pause the answer before opening another checkpoint.")
            return
        spawn(self._open_checkpoint(Path(path)))

    async def _open_checkpoint(self, path: Path) -> None:
        try:
            header = await in_thread(read_header, path)
        except Exception as exc:  # noqa: BLE001 - shown to the user
            self.show_error("Could not open the checkpoint", str(exc))
            return
        conv_id = header.conversation_id
        self.conversation_list.upsert(conv_id, header.title, path=path, top=True)
        self.snapshots.pop(conv_id, None)  # the file is the newer truth
        self.current = conv_id
        self.conversation_list.select(conv_id)
        self._start_opening(conv_id, path)

    def _open_listed(self, conv_id: uuid.UUID) -> None:
        """Open a stored conversation from its newest head; one whose state cannot fit the
        loaded model is shown from its file instead, with what can be done about it."""
        path = self.conversation_list.path_of(conv_id)
        if path is None:
            self.chat_view.set_transcript([])
        elif self.conversation_list.problem_of(conv_id):
            self.show_unopened(conv_id, path)      # open_checkpoint would only fail
        else:
            self._start_opening(conv_id, path)

    def _start_opening(self, conv_id: uuid.UUID, path: Path) -> None:
        self._unopened.pop(conv_id, None)
        self.offer_bar.withdraw()
        self.chat_view.set_transcript([])
        self.chat_view.placeholder = "Opening the conversation…"
        self.chat_view.render()
        self.chat_view.placeholder = "Type a message below and press Enter."
        self.state.opening = (conv_id, path)   # a failure is said here (_on_bridge_engine_failed)
        self.worker.open_checkpoint(path, conv_id)
        self._update_buttons()
        spawn(self._show_while_opening(conv_id, path))

    async def _show_while_opening(self, conv_id: uuid.UUID, path: Path) -> None:
        """The conversation's transcript from its file while the engine opens it, which may
        wait for a model to load first (seconds): it showed nothing, and a message sent
        meanwhile looked like a new conversation's first.  Read-only; Send waits for the
        open (ChatState.can_send)."""
        try:
            _header, meta = await in_thread(read_metadata, path)
        except Exception:  # noqa: BLE001 - the open itself says what is wrong with the file
            return
        if self.current == conv_id and self.state.opening == (conv_id, path):
            self.chat_view.set_transcript(transcript_of(meta), actions=False)

    def show_unopened(self, conv_id: uuid.UUID, path: Path, *, failure: str = "") -> None:
        """Show a conversation the engine does not have open from its file: its transcript
        and, in the offer bar, why it is not open (``failure``, else the compatibility
        rule's reason) and what can be done.  Sending is off until it is open."""
        self._unopened[conv_id] = Path(path)
        self.chat_view.set_transcript([], actions=False)
        self.chat_view.placeholder = "Reading the conversation…"
        self.chat_view.render()
        self.chat_view.placeholder = "Type a message below and press Enter."
        self._update_buttons()
        spawn(self._show_unopened(conv_id, Path(path), failure))

    async def _show_unopened(self, conv_id: uuid.UUID, path: Path, failure: str) -> None:
        try:
            header, meta, model_file = await in_thread(_read_for_offer, path)
        except Exception as exc:  # noqa: BLE001 - said in the window
            if self.current == conv_id and conv_id in self._unopened:
                self.chat_view.placeholder = "The conversation could not be read."
                self.chat_view.render()
                self.chat_view.placeholder = "Type a message below and press Enter."
                self.show_offer(conv_id, "unopened", "Not opened",
                                f"This conversation cannot be opened: {failure or exc}")
            return
        if self.current != conv_id or conv_id not in self._unopened:
            return   # the user went elsewhere, or it was opened meanwhile
        transcript = transcript_of(meta)
        self.chat_view.set_transcript(transcript, actions=False)
        info = self.bridge.model_info
        problem = info.target.problem(header, meta) if info is not None and info.target else None
        theirs = made_with(meta)
        actions = []
        if isinstance(problem, IncompatibleModel):
            text = (f"Made with {theirs}, not with the loaded model. Its saved state fits only {theirs}: "
                    f"load it to go on exactly where it stopped, or continue with {info.name} as a new "
                    "branch (it reads the transcript once).")
            if model_file is not None:
                actions.append((f"Load {theirs}", lambda: self._load_and_open(model_file, path, theirs)))
            else:
                text += f" ({theirs} is no longer where it was: {_recorded_model_path(meta) or '?'}.)"
        else:
            text = f"This conversation could not be opened: {failure or problem or 'no model is loaded'}."
        if info is not None and transcript:
            actions.append((f"Continue with {info.name}", lambda: self.continue_with_loaded_model(conv_id, path)))
        self.show_offer(conv_id, "unopened", "Not opened", text, actions)

    def _load_and_open(self, model_file: Path, path: Path, name: str) -> None:
        """Load the model that made ``path``'s conversation, then open it."""
        if not self.state.idle:
            self.show_message("Model", "Pause the answers before switching models.")
            return
        self.offer_bar.offer(self.offer_bar.conversation, "unopened", f"Loading {name}…", [])
        self._open_after_load = path
        self.switch_model(model_file)

    def continue_with_loaded_model(self, conv_id: uuid.UUID, path: Path) -> None:
        """Go on with another model's conversation with the loaded one, as a new branch
        (its transcript is decoded once when it next answers)."""
        self.offer_bar.offer(conv_id, "unopened", "Taking the conversation over…", [])
        spawn(self._continue_with_loaded_model(conv_id, path))

    async def _continue_with_loaded_model(self, conv_id: uuid.UUID, path: Path) -> None:
        try:
            # reads the file's metadata (on this executor thread), then queues the command
            await in_thread(self.worker.continue_with_loaded_model, path)
        except Exception as exc:  # noqa: BLE001 - said in the window
            if self.current == conv_id and conv_id in self._unopened:
                self.show_unopened(conv_id, path, failure=f"it could not be read ({exc})")

    def open_checkpoint_dialog(self) -> None:
        paths, _ = QFileDialog.getOpenFileNames(self, "Open checkpoint", str(self.store.folder),
                                                "Checkpoints (*.kvckpt);;All files (*)")
        if paths:
            self.import_files([Path(p) for p in paths])

    def import_files(self, paths: list) -> None:
        spawn(self._import_files([Path(p) for p in paths]))

    async def _import_files(self, paths: list[Path]) -> None:
        self.save_progress.show()
        try:
            results: list[FileCheck] = await in_thread(import_files, paths, self.store, self._target())
        except Exception as exc:  # noqa: BLE001 - a store that cannot be written, say: tell the user
            self.show_error("Not imported", f"Nothing was imported: {exc}")
            return
        finally:
            self.save_progress.hide()
        refused = [r for r in results if r.imported is None]
        self.imports_finished.emit(results)
        # what to resume: the file, or the head written on it (transfer's step 5)
        imported = [r.head or r.imported for r in results if r.imported is not None]
        self.refresh_store()
        orphan = next((r for r in refused if r.status == MISSING_PARENT and r.chain_folder), None)
        if orphan is not None:
            self._offer_chain_import(orphan, [r for r in refused if r is not orphan])
        elif refused:
            self.show_error("Not imported", "\n".join(r.message() for r in refused))
        if imported:
            self._offer_resume(imported[-1], import_summary(results))

    def _offer_chain_import(self, orphan: FileCheck, others: list[FileCheck]) -> None:
        """A delta came without its parents, which lie beside it: offer to bring them."""
        text = orphan.message() + "".join("\n" + r.message() for r in others)
        box = QMessageBox(QMessageBox.Icon.Warning, "Not imported", text,
                          QMessageBox.StandardButton.NoButton, self)
        chain = box.addButton("Import its chain", QMessageBox.ButtonRole.AcceptRole)
        box.addButton("Cancel", QMessageBox.ButtonRole.RejectRole)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        box.buttonClicked.connect(lambda b: b is chain and spawn(self._import_chain(orphan.path)))
        box.open()
        self.chain_offer = box
        self.message_shown.emit("Not imported", text)

    async def _import_chain(self, path: Path) -> None:
        await self._import_files(await in_thread(chain_paths, path))

    def _offer_resume(self, path: Path, summary: str) -> None:
        box = QMessageBox(QMessageBox.Icon.Question, "Checkpoint imported",
                          f"{summary} Open “{path.name}” now?", QMessageBox.StandardButton.NoButton, self)
        # (opening shows the conversation where it stopped; a paused answer goes on with
        # Resume: the button said Resume and a second Resume was needed, under Wine)
        open_it = box.addButton("Open", QMessageBox.ButtonRole.AcceptRole)
        box.addButton("Later", QMessageBox.ButtonRole.RejectRole)
        box.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        box.buttonClicked.connect(lambda b: b is open_it and self.open_checkpoint(path))
        box.open()
        self.resume_offer = box

    def validate_checkpoint(self, path: Path) -> None:
        spawn(self._validate(Path(path)))

    async def _validate(self, path: Path) -> FileCheck:
        bar = self.browser.progress if self.browser is not None else None
        if bar is not None:
            bar.setRange(0, 1000)
            bar.setValue(0)
            bar.show()
        last = [-1]

        def progress(done: int, total: int) -> None:
            step = done * 1000 // max(1, total)
            if step != last[0] and bar is not None:  # at most 1000 cross-thread posts
                last[0] = step
                post(step)
        post = thread_safe(lambda v: bar.setValue(v))
        try:
            result = await in_thread(check_file, path, self._target(), progress)
        finally:
            if bar is not None:
                bar.hide()
        if self.browser is not None:
            status = "verified" if result.ok else result.status
            self.browser.model.update_row(path, status=status,
                                          reason="CRC OK" if result.ok else result.reason)
        self.validation_finished.emit(result)
        return result

    def _browser_rename(self, path: Path) -> None:
        row = self.browser.selected_row() if self.browser else None
        if row is None or row.header is None:
            return
        title, ok = QInputDialog.getText(self.browser, "Rename checkpoint", "Title:", text=row.title)
        if ok and title.strip():
            conv_id = row.header.conversation_id
            self.conversation_list.upsert(conv_id, title.strip(), path=path)
            self._rename(conv_id, title.strip())

    def _browser_delete(self, path: Path) -> None:
        row = self.browser.selected_row() if self.browser is not None else None
        named = f"“{row.title}” ({Path(path).name})" if row is not None and row.path == Path(path) and row.title \
            else Path(path).name
        answer = QMessageBox.question(
            self.browser, "Delete checkpoint",
            f"Delete {named}?\nFiles of its chain that nothing else needs go with it.",
            QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No,
            QMessageBox.StandardButton.No)   # (a deletion is never what Enter does)
        if answer == QMessageBox.StandardButton.Yes:
            spawn(self._delete_file(Path(path)))

    async def _delete_file(self, path: Path) -> None:
        try:
            await in_thread(graph.delete_node, self.store, path)
        except (CheckpointError, OSError, ValueError) as exc:
            self.show_error("Not deleted", str(exc))
        self.refresh_store()

    def _browser_export(self, path: Path) -> None:
        target, _ = QFileDialog.getSaveFileName(self.browser, "Export checkpoint",
                                                str(Path.home() / Path(path).name),
                                                "Checkpoints (*.kvckpt)")
        if target:
            self.export_checkpoint(Path(path), Path(target))

    def export_checkpoint(self, path: Path, target: Path) -> None:
        """Write ``path`` as one self-contained file (a delta chain is compacted)."""
        self.save_progress.show()
        self.worker.export(path, target)

    @Slot(str, str)
    def _on_bridge_checkpoint_exported(self, source: str, target: str) -> None:
        self.save_progress.hide()
        self.show_message("Exported", f"Saved {Path(source).name} as one self-contained file: {target}")

    # -- drag and drop ------------------------------------------------------------------------------
    def dragEnterEvent(self, event) -> None:
        if event.mimeData().hasUrls():
            event.acceptProposedAction()

    def dragMoveEvent(self, event) -> None:
        if event.mimeData().hasUrls():
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:
        paths = local_checkpoint_paths(event.mimeData().urls())
        if not paths:
            event.ignore()
            return
        event.acceptProposedAction()
        self.import_files(paths)


def _recorded_model_path(meta: dict) -> str:
    model = meta.get("model")
    value = model.get("path") if isinstance(model, dict) else None
    return value if isinstance(value, str) else ""


def _read_for_offer(path: Path):
    """Header, metadata and the recorded model file when it still exists (any thread)."""
    header, meta = read_metadata(path)
    recorded = _recorded_model_path(meta)
    model_file = Path(recorded) if recorded and Path(recorded).is_file() else None
    return header, meta, model_file
