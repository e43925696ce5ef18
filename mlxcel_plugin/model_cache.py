"""Where converted checkpoints live: one definition for the CLI (which must not
import MLX) and for ``engines.model_store`` (which writes them)."""

from __future__ import annotations

import os
from pathlib import Path

# The embedded SmolLM2-135M-Instruct's directory name, also its served model name.
DEFAULT_MODEL_DIRNAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("MLXCEL_CACHE_DIR") or Path.home() / ".cache" / "mlxcel")
