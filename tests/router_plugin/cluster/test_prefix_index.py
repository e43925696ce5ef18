import pytest

from router_plugin.cluster.node_pool import NodePool, NodeTelemetry
from router_plugin.cluster.prefix_index import PrefixIndex, prompt_blocks


def test_blocks_cover_the_full_chunks_a_node_keeps():
    # A node keeps (T - 1) // B blocks: the last token is computed on its own.
    assert [len(prompt_blocks(range(n), 4)) for n in (1, 4, 5, 8, 9)] == [0, 0, 1, 1, 2]


def test_keys_chain_so_equal_keys_mean_equal_prefixes():
    a, b = prompt_blocks(list(range(13)), 4), prompt_blocks([99, *range(1, 13)], 4)
    assert len(a) == len(b) == 3 and not set(a) & set(b)  # one token differs in block 0
    assert prompt_blocks(list(range(13)) + [7, 7, 7, 7], 4)[:3] == a


def test_cached_tokens_is_the_longest_recorded_prefix():
    index = PrefixIndex(block_tokens=4)
    turn1, turn2 = list(range(10)), list(range(10)) + [50, 51, 52, 53, 54]
    index.record("decode-0", index.blocks(turn1))
    assert index.cached_tokens("decode-0", index.blocks(turn2)) == 8
    assert index.cached_tokens("decode-1", index.blocks(turn2)) == 0
    other = [1000, *range(1, 15)]
    assert index.cached_tokens("decode-0", index.blocks(other)) == 0


def test_each_node_keeps_at_most_its_block_budget_least_recent_out():
    index = PrefixIndex(block_tokens=2, max_blocks_per_node=3)
    index.record("p", index.blocks(list(range(9))))  # 4 blocks: the first is dropped
    assert index.blocks_held("p") == 3
    assert index.cached_tokens("p", index.blocks(list(range(9)))) == 0  # its head is gone


def test_a_node_that_drops_its_link_is_forgotten():
    pool = NodePool.from_peers(["10.0.0.1:1"], ["10.0.0.2:1"], prefixes=PrefixIndex(4))
    blocks = pool.prefixes.blocks(list(range(20)))
    pool.prefixes.record("decode-0", blocks)
    # No report of a prefix cache (off, or not heard from yet): no guess either.
    assert pool.views("decode", 0.0, blocks)[0].cached_prefix_tokens == 0
    pool.update_telemetry("decode-0", NodeTelemetry(prefix_capacity_bytes=1 << 30), now=0.0)
    view = pool.views("decode", 0.5, blocks)[0]
    assert view.cached_prefix_tokens == 16
    pool.mark_unreachable("decode-0", 1.0, "link lost")  # it may come back restarted, empty
    assert pool.views("decode", 2.0, blocks)[0].cached_prefix_tokens == 0


def test_block_size_must_be_positive():
    with pytest.raises(ValueError):
        PrefixIndex(block_tokens=0)
