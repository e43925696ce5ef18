"""One placement (attempt) of a routed request: its wire id and the nodes serving it."""

from __future__ import annotations

from dataclasses import dataclass

from router_plugin.cluster.peer_links import PeerLink


@dataclass
class Placement:
    """One routing attempt of a request: its wire id and the two nodes serving it."""

    attempt: int
    wire_id: str
    prefill: PeerLink | None  # None: the decode node prefills itself (a local request)
    decode: PeerLink
    # "done": that side holds nothing more for this attempt (finished, failed or gone).
    prefill_done: bool = False
    decode_done: bool = False
    # Prompt tokens the decode node was believed to hold when placed (before this request).
    decode_held_tokens: int = 0
    released: bool = False  # its routes freed and its nodes' counts given back

    def sides(self) -> list[tuple[PeerLink, bool]]:
        """(node, done) for each node serving this attempt."""
        both = [(self.prefill, self.prefill_done), (self.decode, self.decode_done)]
        return [(peer, done) for peer, done in both if peer is not None]


def wire_id(request_id: str, attempt: int) -> str:
    # A fresh id per attempt: frames of an abandoned attempt find no route.
    return request_id if attempt == 0 else f"{request_id}~{attempt}"
