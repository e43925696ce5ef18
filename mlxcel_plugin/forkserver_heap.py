"""Imported last by the node forkserver (``node_forkserver.PRELOAD``): freeze its heap, as a
node freezes its own (``gc_pauses.freeze_startup_heap``).

Why: every node forked from the forkserver inherits the ~1M objects its preload imported
(transformers, mlx-lm, FastAPI...), and until the node freezes its own start-up heap each
full collection walks them all, its own start-up collection first.
Frozen here, once, they stay out of every child's scans. The import is the action: a
forkserver's preload runs imports only.
"""

from __future__ import annotations

from mlxcel_plugin.gc_pauses import freeze_startup_heap

freeze_startup_heap()
