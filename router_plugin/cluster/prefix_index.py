"""Which prompt prefixes each node probably holds, as the router saw it place them.

An approximate, router-side index (SGLang's cache-aware router keeps one per
worker the same way), not a replica of the nodes' caches: nodes publish no
per-block events, so the router records the prompts it sends and forgets a
node when its link drops (a restarted node starts empty). A wrong guess costs
only speed: a node that lacks a prefix prefills it (docs/prefix-cache.md).

Keys are chained hashes of whole blocks of ``block_tokens`` tokens, aligned to
position 0 like the nodes' prefill chunks: block i's key covers tokens
``[0, (i + 1) * block_tokens)``, so equal keys mean equal prefixes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

DEFAULT_BLOCK_TOKENS = 128  # the nodes' default prefill chunk
DEFAULT_MAX_BLOCKS_PER_NODE = 1 << 16
MAX_CACHE_KEYS = 1 << 16  # prompt_cache_key -> node, LRU


def prompt_blocks(tokens: Sequence[int], block_tokens: int,
                  adapter: str | None = None) -> tuple[int, ...]:  # fmt: skip
    """Chained keys of the prompt's whole blocks a node keeps: the last token stays out.

    A node caches the full prefill chunks of a prompt of ``T`` tokens, that is
    ``(T - 1) // block_tokens`` blocks (the last token is computed on its own).
    A LoRA ``adapter``'s K/V differ from the base's: its chain starts elsewhere.
    """
    keys, key = [], 0 if adapter is None else hash(("adapter", adapter))
    for end in range(block_tokens, len(tokens), block_tokens):
        key = hash((key, tuple(tokens[end - block_tokens : end])))
        keys.append(key)
    return tuple(keys)


class PrefixIndex:
    """Per node, an LRU of block keys it was sent; pure, no clock."""

    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 max_blocks_per_node: int = DEFAULT_MAX_BLOCKS_PER_NODE):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self.max_blocks_per_node = max_blocks_per_node
        self._nodes: dict[str, OrderedDict[int, None]] = {}
        self._key_nodes: OrderedDict[str, str] = OrderedDict()  # prompt_cache_key -> node

    def record_key(self, key: str | None, node_id: str) -> None:
        """A request with the client's ``prompt_cache_key`` ``key`` was placed on the node."""
        if key is None:
            return
        self._key_nodes[key] = node_id
        self._key_nodes.move_to_end(key)
        while len(self._key_nodes) > MAX_CACHE_KEYS:
            self._key_nodes.popitem(last=False)

    def key_node(self, key: str | None) -> str | None:
        """The node the last request with ``key`` went to (None: none known)."""
        return None if key is None else self._key_nodes.get(key)

    def blocks(self, tokens: Sequence[int], adapter: str | None = None) -> tuple[int, ...]:
        return prompt_blocks(tokens, self.block_tokens, adapter)

    def record(self, node_id: str, blocks: Sequence[int]) -> None:
        """The node was sent a prompt with these blocks: it holds them once it prefills."""
        held = self._nodes.setdefault(node_id, OrderedDict())
        for key in blocks:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.max_blocks_per_node:
            held.popitem(last=False)

    def cached_tokens(self, node_id: str, blocks: Sequence[int]) -> int:
        """Tokens of the longest prefix of ``blocks`` the node is believed to hold."""
        held = self._nodes.get(node_id)
        if not held:
            return 0
        matched = 0
        for key in blocks:
            if key not in held:
                break
            matched += 1
        return matched * self.block_tokens

    def forget(self, node_id: str) -> None:
        """The node may have restarted (its link dropped): assume it holds nothing."""
        self._nodes.pop(node_id, None)
        for key in [k for k, node in self._key_nodes.items() if node == node_id]:
            del self._key_nodes[key]

    def blocks_held(self, node_id: str) -> int:
        return len(self._nodes.get(node_id, ()))
