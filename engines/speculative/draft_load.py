"""Loading ``[speculative] draft_model`` beside the target, after checking their tokenizers.

The draft proposes token ids the target verifies, so both must map every token to the
same id (and end a text with the same ids): anything else is refused at start-up with
one line naming the first difference.
"""

from __future__ import annotations

from pathlib import Path

import mlx.nn as nn
from mlx_lm.utils import load_tokenizer

from engines.model_loader import load_mlx_model
from engines.speculative.verify import supports_speculation
from mlxcel_plugin.errors import ConfigError
from mlxcel_plugin.speculative.settings import SpeculativeConfig


def tokenizer_difference(target_path: str | Path, draft_path: str | Path) -> str | None:
    """What differs between the two checkpoints' tokenizers (None: the same ids)."""
    target, draft = load_tokenizer(Path(target_path)), load_tokenizer(Path(draft_path))
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if len(target_vocab) != len(draft_vocab):
        return f"vocabularies of {len(target_vocab)} and {len(draft_vocab)} tokens"
    for token, token_id in target_vocab.items():
        if draft_vocab.get(token) != token_id:
            return f"token {token!r} is id {token_id} in the target, {draft_vocab.get(token)} here"
    if set(target.eos_token_ids) != set(draft.eos_token_ids):
        return f"end-of-text ids {sorted(target.eos_token_ids)} and {sorted(draft.eos_token_ids)}"
    return None


def load_draft(target_path: str | Path, config: SpeculativeConfig) -> nn.Module | None:
    """The draft model, or None where none is set; ConfigError when it cannot serve."""
    if not config.draft_model:
        return None
    where = f"[speculative] draft_model {config.draft_model}"
    if not (Path(config.draft_model) / "config.json").is_file():
        raise ConfigError(f"{where}: not an mlx-lm checkpoint directory (no config.json)")
    difference = tokenizer_difference(target_path, config.draft_model)
    if difference is not None:
        raise ConfigError(f"{where}: its tokenizer is not the target's ({difference})")
    draft, _ = load_mlx_model(config.draft_model)
    if not supports_speculation(draft):
        raise ConfigError(f"{where}: its layers' caches cannot drop rejected tokens "
                          "(only plain K/V caches can)")
    return draft
