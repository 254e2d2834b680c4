"""Benchmarks: measured side by side, reported as tables and JSON, never asserted.

``python -m benchmarks`` runs the performance suite of issues 2 and 5 (see
:mod:`benchmarks.suite`).  ``ui_stall.py`` and ``reliability.py`` are separate scripts.
"""
