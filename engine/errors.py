"""The error ladder of Checkpoint Chat.

Every error a user can cause or meet derives from :class:`AppError`; its message is
one sentence meant for a person (the CLI prints it on one line, the GUI shows it in a
dialog).  Errors raised by the native layer derive from ``native.errors.NativeError``
instead (native/ sits below engine/ and never imports it); both are user-facing.
Checkpoint problems have their own branch so callers can tell "this file is
damaged" from "this file belongs to another model" without parsing messages.
"""

from __future__ import annotations


class AppError(Exception):
    """Root of every error that is reported to the user rather than a bug."""


class ModelFileMissing(AppError):
    """The model a checkpoint names is not where it was (each front end says how to point
    at it: the command line's ``--model``)."""


class GenerationError(AppError):
    """Generation cannot continue (context full, decode failure)."""


class ContextFull(GenerationError):
    """The conversation no longer fits in the context window."""


class CheckpointError(AppError):
    """A checkpoint file cannot be used; the subclass says why."""


class NotACheckpoint(CheckpointError):
    """The file does not start with the checkpoint magic."""


class UnsupportedVersion(CheckpointError):
    """The file was written by a newer (or unknown) format version."""


class TruncatedCheckpoint(CheckpointError):
    """The file is shorter (or longer) than its header says."""


class CorruptHeader(CheckpointError):
    """The fixed header fails its CRC or holds impossible values."""


class CorruptMetadata(CheckpointError):
    """The JSON metadata block is malformed, too large or too deep."""


class ChecksumMismatch(CheckpointError):
    """The payload does not match its CRC32: the file was damaged."""


class CorruptState(CheckpointError):
    """The KV state bytes do not have the structure the header promises."""


class IncompatibleModel(CheckpointError):
    """The checkpoint was made with another model (fingerprint or shape differ)."""


class IncompatibleContext(CheckpointError):
    """The checkpoint needs other context settings (n_ctx, KV types, flash attention)."""


class IncompatibleState(CheckpointError):
    """The checkpoint's state was written in a llama.cpp state layout this build cannot
    read (another llama.cpp version); its text can still be recomputed."""


class RestoreFailed(CheckpointError):
    """llama.cpp refused the state even though it passed every check."""


class SaveFailed(CheckpointError):
    """Writing a checkpoint failed; the previous file, if any, is untouched."""


class BrokenChain(CheckpointError):
    """A delta checkpoint's parent is missing, damaged, or not the one it was made on."""
