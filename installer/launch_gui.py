"""Frozen entry point of the windowed executable ``CheckpointChat`` (no console).

The Start menu shortcut and the .kvckpt file association start this one; a
double-clicked checkpoint arrives as the first argument and goes to the GUI, which
offers to resume it.
"""

import multiprocessing
import sys

if __name__ == "__main__":
    multiprocessing.freeze_support()
    from native.probe_child import run_if_probe
    status = run_if_probe(sys.argv[1:])
    if status is not None:
        sys.exit(status)
    from gui.app import main
    sys.exit(main(sys.argv[1:]))
