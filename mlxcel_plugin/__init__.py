"""mlxcel-plugin core: hooks, config, link protocol, KV handoff, schedulers.

Nothing here imports MLX, FastAPI, ``engines`` or ``router_plugin`` at module level.
"""

__version__ = "0.1.0"
