"""A prefill node's decode targets: learned profiles, compatible choice, the wire dtype."""

from __future__ import annotations

import asyncio

import pytest

from mlxcel_plugin.compatibility import KVProfile, NodeProfile
from mlxcel_plugin.errors import MlxcelError
from mlxcel_plugin.nodes.decode_allowlist import DecodeAllowlist
from mlxcel_plugin.nodes.decode_targets import INCOMPATIBLE, DecodeTargets


def fingerprint(dtype: str = "float32", layers: int = 4) -> dict:
    array = {"shape": [1, 2, 0, 8], "dtype": dtype, "grow_axis": 2, "coded": True}
    return {"architecture": "llama", "num_layers": layers, "kv_heads": 2, "head_dim": 8,
            "dtype": dtype, "cache_classes": ["KVCache"] * layers,
            "layers": [{"kind": "KVCache", "arrays": [{**array, "name": n} for n in "kv"]}]
            * layers}


def announce(dtype: str = "float32", layers: int = 4) -> dict[str, str]:
    return NodeProfile(KVProfile.from_fingerprint(fingerprint(dtype, layers))).to_announce()


OWN = KVProfile.from_fingerprint(fingerprint())
PEERS = ("d0:1", "d1:1", "d2:1")


def targets(allow: tuple[str, ...] = ()) -> DecodeTargets:
    return DecodeTargets(OWN, PEERS, DecodeAllowlist.parse(allow))


def test_own_peers_in_turn_skipping_those_that_cannot_take_our_kv() -> None:
    chooser = targets()
    chooser.learned("d1:1", announce(layers=6))
    chooser.learned("d2:1", announce("float16"))
    picks = [chooser.choose(None) for _ in range(4)]
    assert picks == [("d0:1", False), ("d2:1", False), ("d0:1", False), ("d2:1", False)]
    assert chooser.refusal("d1:1") == "layer_count_mismatch"
    assert chooser.refusal("d2:1") is None and chooser.refusal("unknown:1") is None
    chooser.learned("d0:1", announce(layers=2))
    chooser.learned("d2:1", announce(layers=2))
    with pytest.raises(MlxcelError) as refused:
        chooser.choose(None)
    assert refused.value.code == INCOMPATIBLE


def test_the_routers_target_is_taken_when_allowed_and_refused_by_name_when_incompatible() -> None:
    chooser = targets(allow=("d1:1",))
    with pytest.raises(MlxcelError) as refused:
        chooser.choose("d0:1")
    assert refused.value.code == "decode_target_refused"
    assert chooser.choose("d1:1") == ("d1:1", True)
    chooser.learned("d1:1", announce(layers=6))
    error = chooser.refused_error("d1:1")
    assert error.code == INCOMPATIBLE and "layer_count_mismatch" in error.message


def test_the_wire_carries_the_narrower_dtype_of_the_pair() -> None:
    chooser = targets()
    chooser.learned("d0:1", announce("float16"))
    chooser.learned("d1:1", announce("bfloat16"))
    assert chooser.wire_dtype("d0:1", "float32") == "float16"
    assert chooser.wire_dtype("d1:1", "float32") == "bfloat16"
    assert chooser.wire_dtype("d0:1", "float32", ["QuantizedKVCache"]) == "float32"
    assert chooser.wire_dtype("d2:1", "float32") == "float32"  # unknown: as it is
    wide = DecodeTargets(KVProfile.from_fingerprint(fingerprint("float16")), PEERS,
                         DecodeAllowlist.parse(()))
    wide.learned("d0:1", announce("float32"))
    assert wide.wire_dtype("d0:1", "float16") == "float16"  # the receiver widens


class _Link:
    def __init__(self, peer_announce: dict[str, str]):
        self.peer_announce = peer_announce


class _Links:
    def __init__(self, announce_of: dict[str, dict[str, str]]):
        self.announce_of, self.dialed = announce_of, []

    async def lanes(self, target: str, count: int) -> list[_Link]:
        self.dialed.append(target)
        if target not in self.announce_of:
            raise ConnectionRefusedError(target)
        return [_Link(self.announce_of[target])]


def test_a_profile_is_learned_from_the_link_verdict_or_left_unknown() -> None:
    chooser = targets()
    links = _Links({"d0:1": announce("float16")})
    asyncio.run(chooser.learn("d0:1", links))
    asyncio.run(chooser.learn("d1:1", links))
    assert chooser.known("d0:1") and not chooser.known("d1:1")
    assert chooser.profiles["d0:1"].dtype == "float16"
    asyncio.run(chooser.learn("d2:1", _Links({"d2:1": {}})))  # an older node: no profile
    assert chooser.known("d2:1") and chooser.refusal("d2:1") is None
