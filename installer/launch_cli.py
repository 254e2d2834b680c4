"""Frozen entry point of the console executable ``checkpoint-chat``.

Same as the ``checkpoint-chat`` console script, plus one hidden duty: the library
probe's child process (native/probe_child.py) is this executable run with
``--probe-llama-library FOLDER``, since a frozen app has no ``python -m``.
"""

import multiprocessing
import sys

if __name__ == "__main__":
    multiprocessing.freeze_support()
    from native.probe_child import run_if_probe
    status = run_if_probe(sys.argv[1:])
    if status is not None:
        sys.exit(status)
    from gui.launcher import main
    sys.exit(main())
