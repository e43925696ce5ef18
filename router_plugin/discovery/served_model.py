"""Which discovery entries belong to a router pool, by the model NAME an entry carries.

A router serving several models (``cluster/model_pools.py``) runs its sources once
per model; a shared peers file, LAN or namespace lists the nodes of every model.
An entry that names its model (peers-file ``model = "NAME"``, mdns TXT ``model``,
the Kubernetes label ``mlxcel.io/model``) joins only that model's pool; one that
names none joins every pool, where the link verdict's model digest still refuses
a node of another model.
"""

from __future__ import annotations

from pathlib import Path

from mlxcel_plugin.config import ServerConfig

MODEL_KEY = "model"  # peers-file key and mdns TXT key
MODEL_LABEL = "mlxcel.io/model"  # Kubernetes pod label


def pool_model(config: ServerConfig) -> str | None:
    """The model NAME a pool of a several-model router serves; None (take every entry)
    for a one-model router, whose nodes may announce another alias of its model."""
    if not config.section("models"):
        return None
    if config.served_model_name:
        return config.served_model_name
    return Path(config.model).name if config.model else None


def belongs(entry_model: str | None, pool: str | None) -> bool:
    """Whether an entry naming ``entry_model`` (None or "": none) joins the pool ``pool``."""
    return not entry_model or pool is None or entry_model == pool
