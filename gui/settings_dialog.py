"""The Settings dialog: a form over :class:`gui.settings.AppSettings`."""

from __future__ import annotations

from PySide6.QtWidgets import (
    QCheckBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.sampling import SamplerSettings
from engine.worker import ModelInfo
from gui.settings import NONE_AT_ZERO, SAMPLER_KEYS, AppSettings

_MODEL_KEYS = ("model_path", "n_ctx", "n_threads", "n_gpu_layers", "rpc_servers", "sequences")


class SettingsDialog(QDialog):
    def __init__(self, settings: AppSettings, model: ModelInfo | None, parent=None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self.settings = settings
        self.model_changed = False
        # the form scrolls where the screen is lower than it (a laptop's 768 pixels): squeezed,
        # its wrapped lines were cut in half (seen under Xvfb at 900); the buttons stay below
        outer = QVBoxLayout(self)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        inner = QWidget()
        form = QFormLayout(inner)
        scroll.setWidget(inner)
        outer.addWidget(scroll, 1)
        self.fields: dict[str, QWidget] = {}

        def path_row(key: str, label: str, folder: bool, hint: str = "") -> None:
            edit = QLineEdit(str(getattr(settings, key)))
            edit.setPlaceholderText(hint)
            browse = QPushButton("Browse…")
            browse.clicked.connect(lambda: self._browse(edit, folder))
            row = QHBoxLayout()
            row.addWidget(edit, 1)
            row.addWidget(browse)
            form.addRow(label, row)
            self.fields[key] = edit

        defaults = model.sampling_defaults if model is not None else SamplerSettings()
        self.sampling_defaults = defaults

        def spin(key: str, label: str, lo, hi, step=1, decimals=None, special: str = "") -> None:
            box = QDoubleSpinBox() if decimals is not None else QSpinBox()
            if decimals is not None:
                box.setDecimals(decimals)
            box.setRange(lo, hi)
            box.setSingleStep(step)
            value = getattr(settings, key)
            if key in NONE_AT_ZERO:
                value = max(value, 0)
            box.setValue(getattr(defaults, key) if value is None else value)   # unset: the model's
            if special:
                box.setSpecialValueText(special)
            form.addRow(label, box)
            self.fields[key] = box

        path_row("model_path", "Model (GGUF):", False, "default: SmolLM2-135M-Instruct")
        path_row("llama_lib", "llama library folder:", True, "default: the bundled library")
        loaded = (f"Loaded: {model.library_version} · {model.backend}\n{model.library_path}\n"
                  "(passed the ABI check; a new folder takes effect at the next start)"
                  if model else "No library loaded yet")
        info = QLabel(loaded)
        info.setWordWrap(True)
        form.addRow("", info)
        spin("n_gpu_layers", "GPU layers:", 0, 999)
        self._workers_row(form)
        spin("n_ctx", "Context size (tokens):", 256, 1 << 20, 256)
        spin("n_threads", "Threads:", 0, 256, special="auto")
        spin("sequences", "Conversations in the cache:", 1, 16)
        self.fields["sequences"].setToolTip(
            "How many conversations stay in the KV cache at once (sharing its context size): "
            "switching to one of them restores nothing, and as many answers can generate together.")
        spin("temperature", "Temperature:", 0.0, 5.0, 0.05, 2)
        spin("top_k", "Top-k:", 0, 1000)
        spin("top_p", "Top-p:", 0.0, 1.0, 0.01, 2)
        spin("min_p", "Min-p:", 0.0, 1.0, 0.01, 2)
        spin("repeat_penalty", "Repeat penalty:", 0.5, 3.0, 0.05, 2)
        self._model_defaults_row(form, model.sampling_source if model is not None else "no model loaded")
        spin("seed", "Seed:", -1, 2**31 - 1, special="random")
        spin("n_predict", "Answer limit (tokens):", 0, 1 << 20, special="none")
        spin("autosave_every", "Autosave every (tokens):", 0, 100000, 16, special="off")
        path_row("checkpoint_dir", "Checkpoint folder:", True, "default: the app's data folder")
        spin("autosave_budget_mb", "Disk budget for superseded checkpoints (MB):", 1, 1 << 20, 256)
        self._server_row(form)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        outer.addWidget(buttons)
        self._fit(scroll, inner)

    def _fit(self, scroll: QScrollArea, inner: QWidget) -> None:
        """As large as the form where the screen allows (a scroll area alone opens small)."""
        want = inner.sizeHint()
        screen = self.screen().availableGeometry() if self.screen() is not None else None
        height = want.height() if screen is None else min(want.height(), screen.height() - 160)
        scroll.setMinimumSize(want.width() + scroll.verticalScrollBar().sizeHint().width(), max(200, height))

    def _workers_row(self, form: QFormLayout) -> None:
        """Remote workers (llama.cpp RPC) the GPU layers go to."""
        workers = QLineEdit(self.settings.rpc_servers)
        workers.setObjectName("rpcServers")
        workers.setPlaceholderText("host:port, host:port — empty: this machine only")
        workers.setToolTip("Machines running `checkpoint-chat rpc-worker`: the GPU layers go to them "
                           "(999: all). Unencrypted and unauthenticated: trusted networks only.")
        form.addRow("Remote workers:", workers)
        self.fields["rpc_servers"] = workers

    def _model_defaults_row(self, form: QFormLayout, source: str) -> None:
        """The model's own sampling settings (from ``source``), and a button that uses them."""
        defaults = self.sampling_defaults
        reset = QPushButton("Use the model's defaults")
        reset.setObjectName("samplingDefaults")
        reset.clicked.connect(self._use_model_defaults)
        note = QLabel(f"Model defaults: temperature {defaults.temperature:g}, top-k {defaults.top_k}, "
                      f"top-p {defaults.top_p:g}, min-p {defaults.min_p:g}, repeat penalty "
                      f"{defaults.repeat_penalty:g} ({source})")
        note.setWordWrap(True)   # (a row of its own: beside the button its third line was cut)
        form.addRow("", note)
        form.addRow("", reset)

    def _server_row(self, form: QFormLayout) -> None:
        """Local server: on/off and its port (127.0.0.1 only; gui.local_server)."""
        switch = QCheckBox("Serve an OpenAI-compatible API on 127.0.0.1, port")
        switch.setObjectName("localServerSwitch")
        switch.setChecked(bool(self.settings.local_server))
        switch.setToolTip("Editors, agents and scripts can use the loaded model with any OpenAI client; "
                          "their conversations are checkpointed and appear in the list")
        port = QSpinBox()
        port.setObjectName("localServerPort")
        port.setRange(1024, 65535)
        port.setValue(min(65535, max(1024, self.settings.local_server_port)))
        row = QHBoxLayout()
        row.addWidget(switch)
        row.addWidget(port)
        row.addStretch(1)
        form.addRow("Local server:", row)
        self.fields["local_server"] = switch
        self.fields["local_server_port"] = port

    def _browse(self, edit: QLineEdit, folder: bool) -> None:
        if folder:
            path = QFileDialog.getExistingDirectory(self, "Choose a folder", edit.text())
        else:
            path, _ = QFileDialog.getOpenFileName(self, "Choose a model", edit.text(), "GGUF (*.gguf)")
        if path:
            edit.setText(path)

    def _use_model_defaults(self) -> None:
        for key in SAMPLER_KEYS:
            self.fields[key].setValue(getattr(self.sampling_defaults, key))

    def accept(self) -> None:
        for key, widget in self.fields.items():
            if isinstance(widget, QCheckBox):
                value = int(widget.isChecked())
            else:
                value = widget.text() if isinstance(widget, QLineEdit) else widget.value()
            if key in NONE_AT_ZERO and value == 0:
                value = -1
            if key in _MODEL_KEYS and value != getattr(self.settings, key):
                self.model_changed = True
            if key in SAMPLER_KEYS and value == getattr(self.sampling_defaults, key):
                value = None   # the model's own: follows the model when another one is loaded
            setattr(self.settings, key, value)
        self.settings.sync()
        super().accept()
