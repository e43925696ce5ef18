"""What a node announces about what its KV is, and which peers can take it (docs/compatibility.md).

Every prefill and decode node puts a ``NodeProfile`` in its link verdict (and
its mdns TXT): a compact summary of its engine's KV fingerprint (layers, heads,
head_dim, dtype, cache kinds, ``kv_bits``/group size, weights digest, and a
digest of the whole per-layer description), plus digests of its tokenizer and
chat template. The router and the prefill nodes read it before any request:
``kv_refusal`` says why a decode node cannot take a prefill node's KV (None:
it can), ``kv_conversion`` what is converted on the way (another dtype; plain
K/V a ``kv_bits`` receiver quantizes: kv_serde/convert.py), ``text_refusal``
why a node's tokenizer or template differs from the router's. Unknown (an
older peer's silence) never refuses.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ANNOUNCE_KV = "kv"
ANNOUNCE_TOKENIZER = "tokenizer"
ANNOUNCE_CHAT_TEMPLATE = "chat_template"
DIGEST_CHARS = 16
MAX_ANNOUNCE_CHARS = 1024  # the verdict holds 4 KiB in all
# Files that decide token ids (the chat template is checked on its own).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json")
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
TOKENIZER_CONFIG = "tokenizer_config.json"
UNQUANTIZED = "unquantized"  # a kv_bits engine's plain layers (kv_serde/convert.py)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:DIGEST_CHARS]


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class KVProfile:
    """The parts of a KV fingerprint a receiver must share with a sender."""

    architecture: str
    layers: int
    kv_heads: int  # 0: not uniform across layers (``layout`` tells them apart)
    head_dim: int
    dtype: str
    kinds: tuple[str, ...]  # the distinct cache kinds, sorted
    kv_bits: int = 0  # 0: plain KV
    kv_group_size: int = 0
    weights: str = ""  # the fingerprint's model digest, when the engine sets one
    layout: str = ""  # digest of the whole per-layer description
    # Digest of the plain per-layer description without dtypes: what a conversion keeps.
    base: str = ""

    @classmethod
    def from_fingerprint(cls, fingerprint: Mapping[str, Any], kv_bits: int = 0,
                         kv_group_size: int = 0) -> KVProfile:
        """From an engine's ``ModelInfo.fingerprint`` and its ``[engine] kv_bits``."""
        kinds = tuple(sorted(set(fingerprint.get("cache_classes", ()))))
        return cls(str(fingerprint.get("architecture", "")), int(fingerprint.get("num_layers", 0)),
                   int(fingerprint.get("kv_heads", 0)), int(fingerprint.get("head_dim", 0)),
                   str(fingerprint.get("dtype", "")), kinds, kv_bits,
                   kv_group_size if kv_bits else 0, str(fingerprint.get("model_digest", "")),
                   _digest(_canonical(dict(fingerprint))), _base_digest(fingerprint))

    def to_announce(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_announce(cls, text: str) -> KVProfile | None:
        """A peer's announced profile; None when absent or unreadable (treated as unknown)."""
        try:
            data = json.loads(text[:MAX_ANNOUNCE_CHARS])
            return cls(str(data["architecture"]), int(data["layers"]), int(data["kv_heads"]),
                       int(data["head_dim"]), str(data["dtype"]),
                       tuple(str(k) for k in data["kinds"]), int(data.get("kv_bits", 0)),
                       int(data.get("kv_group_size", 0)), str(data.get("weights", "")),
                       str(data.get("layout", "")), str(data.get("base", "")))
        except (ValueError, KeyError, TypeError):
            return None

    def summary(self) -> str:
        """One line for /router/stats and logs: ``fake 4L 2x8 float32 KVCache``."""
        heads = f"{self.kv_heads}x{self.head_dim}" if self.kv_heads else "mixed"
        bits = f" kv_bits={self.kv_bits}/{self.kv_group_size}" if self.kv_bits else ""
        return f"{self.architecture} {self.layers}L {heads} {self.dtype} " \
               f"{'+'.join(self.kinds)}{bits}"


def _base_digest(fingerprint: Mapping[str, Any]) -> str:
    """The plain layers (a kv_bits engine's unquantized ones) with every dtype left out."""
    plain = fingerprint.get(UNQUANTIZED)
    layers = (plain if isinstance(plain, Mapping) else fingerprint).get("layers")
    if not isinstance(layers, list | tuple):
        return ""
    try:
        shapes = [{"kind": layer["kind"],
                   "arrays": [{k: v for k, v in a.items() if k != "dtype"}
                              for a in layer["arrays"]]}
                  for layer in layers]
    except (KeyError, TypeError, AttributeError):
        return ""
    return _digest(_canonical([fingerprint.get("architecture", ""), shapes]))


# Checked in this order, so a refusal names the most telling difference.
_SAME_FORM_CHECKS = (
    ("kv_heads", "kv_heads_mismatch"),
    ("head_dim", "head_dim_mismatch"),
    ("kinds", "cache_kind_mismatch"),
)


def _quantizes_on_arrival(sender: KVProfile, receiver: KVProfile) -> bool:
    return sender.kv_bits == 0 and receiver.kv_bits != 0


def kv_refusal(sender: KVProfile | None, receiver: KVProfile | None) -> str | None:
    """Why ``receiver`` cannot take ``sender``'s KV; None when it can (or either is unknown).

    Converts: another float dtype, and plain K/V to a ``kv_bits`` receiver (it
    quantizes on arrival). Never: layer count, heads, head_dim, cache kinds, other
    ``kv_bits``, packed (quantized) K/V in another dtype, other weights.
    """
    if sender is None or receiver is None:
        return None
    if sender.layers != receiver.layers:
        return "layer_count_mismatch"
    quantizes = _quantizes_on_arrival(sender, receiver)
    if not quantizes and (sender.kv_bits, sender.kv_group_size) != (
            receiver.kv_bits, receiver.kv_group_size):
        return "kv_bits_mismatch"
    if sender.architecture != receiver.architecture:
        return "architecture_mismatch"
    casts = sender.dtype != receiver.dtype
    if casts and sender.kv_bits:
        return "dtype_mismatch"  # packed words, scales and biases are not re-cast
    if sender.weights and receiver.weights and sender.weights != receiver.weights:
        return "weights_mismatch"
    if not quantizes:
        for name, reason in _SAME_FORM_CHECKS:
            if getattr(sender, name) != getattr(receiver, name):
                return reason
    if not (quantizes or casts):
        return "kv_layout_mismatch" if _differs(sender.layout, receiver.layout) else None
    if not (sender.base and receiver.base):  # an older announce: the forms cannot be compared
        return "kv_bits_mismatch" if quantizes else "dtype_mismatch"
    return "kv_layout_mismatch" if sender.base != receiver.base else None


def _differs(ours: str, theirs: str) -> bool:
    return bool(ours and theirs and ours != theirs)


def kv_conversion(sender: KVProfile | None, receiver: KVProfile | None) -> str:
    """What converts when ``receiver`` takes ``sender``'s KV ("" when nothing does)."""
    if sender is None or receiver is None or kv_refusal(sender, receiver) is not None:
        return ""
    steps = [f"{sender.dtype}->{receiver.dtype}"] if sender.dtype != receiver.dtype else []
    if _quantizes_on_arrival(sender, receiver):
        steps.append(f"quantize kv_bits={receiver.kv_bits}/{receiver.kv_group_size}")
    return "+".join(steps)


@dataclass(frozen=True)
class NodeProfile:
    """What a node announces: its KV profile and its tokenizer and chat template digests."""

    kv: KVProfile | None = None
    tokenizer: str | None = None
    chat_template: str | None = None

    def to_announce(self) -> dict[str, str]:
        fields = {ANNOUNCE_KV: self.kv.to_announce() if self.kv else None,
                  ANNOUNCE_TOKENIZER: self.tokenizer, ANNOUNCE_CHAT_TEMPLATE: self.chat_template}
        return {key: value for key, value in fields.items() if value}

    @classmethod
    def from_announce(cls, announce: Mapping[str, str]) -> NodeProfile:
        kv = announce.get(ANNOUNCE_KV)
        return cls(KVProfile.from_announce(kv) if kv else None,
                   announce.get(ANNOUNCE_TOKENIZER) or None,
                   announce.get(ANNOUNCE_CHAT_TEMPLATE) or None)

    @classmethod
    def of_text(cls, model_dir: str | Path | None) -> NodeProfile:
        """The tokenizer and template digests of a checkpoint (the router's own)."""
        return cls(None, tokenizer_digest(model_dir), chat_template_digest(model_dir))


def text_refusal(node: NodeProfile, router: NodeProfile) -> str | None:
    """Why the router (which tokenizes and detokenizes) must not use ``node``; None: fine."""
    for name in ("tokenizer", "chat_template"):
        theirs, ours = getattr(node, name), getattr(router, name)
        if theirs and ours and theirs != ours:
            return f"{name}_mismatch"
    return None


def _tokenizer_config(model_dir: Path) -> dict[str, Any]:
    try:
        config = json.loads((model_dir / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def tokenizer_digest(model_dir: str | Path | None) -> str | None:
    """A digest of the files that decide token ids (None: no tokenizer found)."""
    if model_dir is None:
        return None
    root = Path(model_dir)
    config = {k: v for k, v in _tokenizer_config(root).items() if k != "chat_template"}
    parts = [_canonical(config)] if config else []
    for name in TOKENIZER_FILES:
        path = root / name
        if path.is_file():
            parts.append(name.encode() + b"\0" + path.read_bytes())
    return _digest(b"\0".join(parts)) if parts else None


def chat_template_digest(model_dir: str | Path | None) -> str | None:
    """A digest of the checkpoint's chat template(s) (None: it has none)."""
    if model_dir is None:
        return None
    root = Path(model_dir)
    template = _tokenizer_config(root).get("chat_template")
    parts = [_canonical(template)] if template else []
    for name in TEMPLATE_FILES:
        path = root / name
        if path.is_file():
            parts.append(path.read_bytes())
    return _digest(b"\0".join(parts)) if parts else None
