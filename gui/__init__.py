"""The desktop app (PySide6).  Never calls native/: all model work runs in engine/ on its thread."""
