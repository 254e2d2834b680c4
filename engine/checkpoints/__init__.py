"""Everything about checkpoint files, and nothing about running a model.

``format`` (the byte spec), ``kvstate`` (the llama.cpp state walker), ``fingerprint``
(model identity), ``atomic`` (crash-safe writes), ``compat`` (can this header be restored
into this model and context?), ``chain`` (delta links), ``graph`` (the store as a graph
of heads and chains: prune, retire, delete), ``store`` (the folder, names, lock, listing),
``transfer`` (import and export) and ``prefix_index`` (which file shares a prompt's
beginning).  Nothing here imports the worker, the window or llama.cpp.
"""
