"""Pairing known before traffic: profiles, refusals by reason (counted once), cooldowns."""

from __future__ import annotations

import dataclasses
import json

from mlxcel_plugin.compatibility import (
    KVProfile,
    NodeProfile,
    chat_template_digest,
    kv_conversion,
    kv_refusal,
    text_refusal,
    tokenizer_digest,
)
from router_plugin.cluster.node_pool import NodePool
from router_plugin.cluster.pairing import ROUTER, PairingTable, Refusal

FINGERPRINT = {"architecture": "fake", "num_layers": 4, "kv_heads": 2, "head_dim": 8,
               "dtype": "float32", "cache_classes": ["KVCache"] * 4}
KV = KVProfile.from_fingerprint(FINGERPRINT)
TEXT = NodeProfile(None, "tok", "tpl")


def described(dtype: str = "float32", heads: int = 2, **changes) -> dict:
    """A fingerprint with its layers described, as engines announce them."""
    array = {"shape": [1, heads, 0, 8], "dtype": dtype, "grow_axis": 2, "coded": True}
    layers = [{"kind": "KVCache", "arrays": [{**array, "name": n} for n in "kv"]}] * 4
    return {**FINGERPRINT, "dtype": dtype, "kv_heads": heads, "layers": layers, **changes}


def quantizing(dtype: str = "float32") -> dict:
    """A kv_bits engine's fingerprint: quantized layers, its plain ones kept beside them."""
    plain = described(dtype)
    quant = [{"kind": "QuantizedKVCache", "arrays": [
        {"name": f"{t}{p}", "shape": [1, 2, 0, w], "dtype": d, "grow_axis": 2}
        for t in "kv" for p, w, d in (("", 2, "uint32"), (".scales", 1, dtype),
                                       (".biases", 1, dtype))]}] * 4
    return {**plain, "kv_heads": 0, "head_dim": 0, "cache_classes": ["QuantizedKVCache"] * 4,
            "layers": quant, "unquantized": {key: plain[key] for key in (
                "kv_heads", "head_dim", "cache_classes", "layers")}}


def node(kv: KVProfile = KV, tokenizer: str = "tok", template: str = "tpl") -> NodeProfile:
    return NodeProfile(kv, tokenizer, template)


def test_kv_refusal_names_the_most_telling_difference() -> None:
    other_layers = KVProfile.from_fingerprint({**FINGERPRINT, "num_layers": 6,
                                               "cache_classes": ["KVCache"] * 6})
    assert kv_refusal(KV, KV) is None
    assert kv_refusal(KV, other_layers) == "layer_count_mismatch"
    assert kv_refusal(KV, dataclasses.replace(KV, head_dim=16)) == "head_dim_mismatch"
    assert kv_refusal(KV, KVProfile.from_fingerprint(FINGERPRINT, 8, 64)) == "kv_bits_mismatch"
    assert kv_refusal(KV, dataclasses.replace(KV, dtype="float16")) == "dtype_mismatch"
    assert kv_refusal(KV, dataclasses.replace(KV, kinds=("RotatingKVCache",))) \
        == "cache_kind_mismatch"
    assert kv_refusal(KV, dataclasses.replace(KV, layout="other")) == "kv_layout_mismatch"
    assert kv_refusal(None, KV) is None and kv_refusal(KV, None) is None  # unknown: no refusal


def test_dtype_and_plain_to_kv_bits_convert_and_the_rest_stays_refused() -> None:
    f32, f16 = KVProfile.from_fingerprint(described()), KVProfile.from_fingerprint(
        described("float16"))
    assert kv_refusal(f32, f16) is None and kv_conversion(f32, f16) == "float32->float16"
    assert kv_refusal(f16, f32) is None and kv_conversion(f16, f32) == "float16->float32"
    assert kv_conversion(f32, f32) == ""
    quant8 = KVProfile.from_fingerprint(quantizing("float16"), 8, 32)
    assert kv_refusal(f32, quant8) is None
    assert kv_conversion(f32, quant8) == "float32->float16+quantize kv_bits=8/32"
    assert kv_refusal(quant8, f16) == "kv_bits_mismatch"  # packed K/V are not dequantized
    quant4 = KVProfile.from_fingerprint(quantizing("float16"), 4, 32)
    assert kv_refusal(quant4, quant8) == "kv_bits_mismatch"
    quant8_f32 = KVProfile.from_fingerprint(quantizing("float32"), 8, 32)
    assert kv_refusal(quant8_f32, quant8) == "dtype_mismatch"  # packed K/V are not re-cast
    other_heads = KVProfile.from_fingerprint(described("float16", heads=4))
    assert kv_refusal(f32, other_heads) == "kv_heads_mismatch"
    assert kv_conversion(f32, other_heads) == ""
    # Another layout hidden behind equal summaries: the dtype-free digests differ.
    assert kv_refusal(f32, dataclasses.replace(f16, base="other")) == "kv_layout_mismatch"
    # An older announce (no base): another dtype cannot be judged convertible.
    assert kv_refusal(KV, dataclasses.replace(KV, dtype="float16")) == "dtype_mismatch"


def test_a_profile_survives_the_announcement() -> None:
    profile = node(KVProfile.from_fingerprint(FINGERPRINT, 8, 64))
    announce = profile.to_announce()
    assert sum(len(v) for v in announce.values()) < 1024  # the verdict holds 4 KiB in all
    assert NodeProfile.from_announce(announce) == profile
    assert NodeProfile.from_announce({}) == NodeProfile()
    assert NodeProfile.from_announce({"kv": "{not json"}).kv is None
    assert profile.kv.summary() == "fake 4L 2x8 float32 KVCache kv_bits=8/64"


def test_text_refusal_compares_with_the_routers_digests() -> None:
    assert text_refusal(node(), TEXT) is None
    assert text_refusal(node(tokenizer="other"), TEXT) == "tokenizer_mismatch"
    assert text_refusal(node(template="other"), TEXT) == "chat_template_mismatch"
    assert text_refusal(NodeProfile(), TEXT) is None


def test_digests_follow_the_tokenizer_and_template_files(tmp_path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"model": "a"}')
    config = {"eos_token": "</s>", "chat_template": "{{ messages }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer, template = tokenizer_digest(tmp_path), chat_template_digest(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "x"}))
    assert tokenizer_digest(tmp_path) == tokenizer and chat_template_digest(tmp_path) != template
    (tmp_path / "tokenizer.json").write_text('{"model": "b"}')
    assert tokenizer_digest(tmp_path) != tokenizer
    assert tokenizer_digest(tmp_path / "missing") is None and chat_template_digest(None) is None


def test_refusals_are_counted_once_whichever_side_announces_again() -> None:
    table = PairingTable(TEXT)
    other = KVProfile.from_fingerprint({**FINGERPRINT, "num_layers": 2,
                                        "cache_classes": ["KVCache"] * 2})
    assert table.set_profile("prefill-0", "prefill", node()) == []
    assert table.set_profile("decode-0", "decode", node()) == []
    assert table.set_profile("decode-1", "decode", node(other)) == [
        Refusal("decode-1", "prefill-0", "layer_count_mismatch")]
    assert table.set_profile("prefill-0", "prefill", node()) == []  # a reconnect: known
    assert table.set_profile("decode-2", "decode", node(tokenizer="x")) == [
        Refusal("decode-2", ROUTER, "tokenizer_mismatch")]
    assert dict(table.reason_counts) == {"layer_count_mismatch": 1, "tokenizer_mismatch": 1}
    assert table.partners("prefill-0", ["decode-0", "decode-1"]) == ["decode-0"]
    assert table.partners("decode-1", ["prefill-0"]) == []


def test_cooldown_doubles_and_a_landed_handoff_resets_it() -> None:
    table = PairingTable(cooldown_s=1.0, max_cooldown_s=3.0)
    assert [table.cool("p", "d", now=0.0) for _ in range(3)] == [1.0, 2.0, 3.0]
    assert table.cooling("p", "d", 2.9) and not table.cooling("p", "d", 3.0)
    table.succeeded("p", "d")
    assert table.cool("p", "d", now=10.0) == 1.0


def pool_with(decode_kv: list[KVProfile]) -> NodePool:
    pool = NodePool.from_peers(["p:1"], [f"d:{i}" for i in range(len(decode_kv))],
                               pairing=PairingTable(TEXT))
    pool.pairing.set_profile("prefill-0", "prefill", node())
    for i, kv in enumerate(decode_kv):
        pool.pairing.set_profile(f"decode-{i}", "decode", node(kv))
        pool.mark_healthy(f"decode-{i}", 0.0)
    pool.mark_healthy("prefill-0", 0.0)
    return pool


def test_the_pool_never_offers_an_incompatible_pair() -> None:
    pool = pool_with([KV, dataclasses.replace(KV, layers=2)])
    assert pool.unpaired_decodes(set(), now=0.0) == {"decode-1"}
    assert pool.unpaired_prefills("decode-1", now=0.0) == {"prefill-0"}
    entry = pool.stats(0.0)["decode"][1]
    assert entry["pairs"] == [] and entry["kv"] == "fake 2L 2x8 float32 KVCache"
    assert entry["refused"] == [{"with": "prefill-0", "reason": "layer_count_mismatch"}]
    assert pool.stats(0.0)["prefill"][0]["pairs"] == ["decode-0"]


def test_a_converting_pair_is_formed_and_shows_how() -> None:
    pool = pool_with([KVProfile.from_fingerprint(described("float16")),
                      KVProfile.from_fingerprint(quantizing(), 8, 32)])
    pool.pairing.set_profile("prefill-0", "prefill", node(KVProfile.from_fingerprint(described())))
    assert pool.unpaired_decodes(set(), now=0.0) == set()
    decode_f16, decode_q8 = pool.stats(0.0)["decode"]
    assert decode_f16["pairs"] == ["prefill-0"] and decode_f16["refused"] == []
    assert decode_f16["converts"] == [{"with": "prefill-0", "converts": "float32->float16"}]
    assert decode_q8["converts"] == [{"with": "prefill-0", "converts": "quantize kv_bits=8/32"}]
    assert pool.stats(0.0)["prefill"][0]["converts"] == [
        {"with": "decode-0", "converts": "float32->float16"},
        {"with": "decode-1", "converts": "quantize kv_bits=8/32"}]


def test_a_cooling_pair_is_skipped_only_while_another_pair_remains() -> None:
    pool = pool_with([KV, KV])
    pool.pairing.cool("prefill-0", "decode-0", now=0.0)
    assert pool.unpaired_decodes(set(), now=0.5) == {"decode-0"}
    pool.pairing.cool("prefill-0", "decode-1", now=0.0)
    assert pool.unpaired_decodes(set(), now=0.5) == set()  # all cool: still compatible
    assert pool.unpaired_prefills("decode-0", now=0.5) == set()


def test_a_node_refused_by_the_router_is_never_healthy_to_selection() -> None:
    pool = pool_with([KV])
    pool.pairing.set_profile("decode-0", "decode", node(template="other"))
    (view,) = pool.views("decode", now=0.0)
    assert not view.healthy
    assert pool.stats(0.0)["decode"][0]["refused"] == [
        {"with": ROUTER, "reason": "chat_template_mismatch"}]


def test_discovery_pins_a_profile_and_membership_refuses_another_tokenizer() -> None:
    import asyncio

    from mlxcel_plugin.discovery_api import Member, pinned_profile
    from router_plugin.cluster.peer_links import PeerLinks
    from router_plugin.discovery.membership import Membership
    from router_plugin.discovery.peers_file import _member

    assert pinned_profile({"address": "a:1"}) is None
    pinned = _member("decode", {"address": "10.0.0.1:9000", "tokenizer": "other",
                                "kv": KV.to_announce()}, "file")
    assert pinned.profile == NodeProfile(KV, "other", None)

    async def never_connects(address: str, role: str):
        await asyncio.Event().wait()

    async def main():
        pool = NodePool(pairing=PairingTable(TEXT))
        membership = Membership(PeerLinks(pool, never_connects), lambda node_id: None,
                                fingerprint=None)
        assert membership.refusal(pinned) == "tokenizer_mismatch (pinned by file)"
        same = Member("decode", "10.0.0.2:9000", None, "file", NodeProfile(KV, "tok", "tpl"))
        assert membership.refusal(same) is None
        membership.update("file", frozenset({pinned}))
        assert pool.ids("decode") == []  # never joined, never dialled

    asyncio.run(main())
