"""Errors raised by the native layer; all are meant for the user, none is a bug."""


class NativeError(Exception):
    """Root of the native layer's user-facing errors."""


class LibraryError(NativeError):
    """The llama.cpp library could not be found, loaded, or safely called."""


class ModelLoadError(NativeError):
    """A model file is missing, unreadable, or not a model llama.cpp can load."""


class ContextError(NativeError):
    """A context could not be created with the requested parameters."""


class DecodeError(NativeError):
    """llama_decode failed (no KV slot, compute error)."""


class StateError(NativeError):
    """llama.cpp refused to read or write a sequence state."""
