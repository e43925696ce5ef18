"""TransferConfig, BandwidthEstimator and AdaptiveSelector (injected clock and estimates)."""

from __future__ import annotations

import pytest

from mlxcel_plugin.errors import ConfigError, PluginError
from mlxcel_plugin.plugins import load_plugins
from mlxcel_plugin.transfer import (
    AdaptiveSelector,
    BandwidthEstimator,
    FullTransfer,
    SelectorTuning,
    StreamedTransfer,
    TransferConfig,
)
from mlxcel_plugin.transfer.pacing import LINK, RECEIVER, SENDER

MB = 1_000_000
REGISTRY = load_plugins(env={"MLXCEL_PLUGINS": "core"})
STRATEGIES = REGISTRY.entries["transfer_strategy"]
CODECS = REGISTRY.entries["kv_codec"]


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- config ----------------------------------------------------------------


def test_config_defaults_leave_the_choice_to_the_selector():
    config = TransferConfig()
    assert (config.strategy, config.codec, config.parallelism) == ("auto", "auto", 1)
    assert config.chunk_bytes == 32 << 20 and not config.allow_lossy
    assert config.record_chunk_bytes == (8 << 20) - (64 << 10)  # a codec's pipeline, per record


def test_config_from_dict_round_trips_and_refuses_unknown_keys():
    config = TransferConfig.from_dict({"strategy": "streamed", "parallelism": 4})
    assert TransferConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match="chunk_size"):
        TransferConfig.from_dict({"chunk_size": 1})


@pytest.mark.parametrize(
    "bad",
    [
        {"parallelism": 0},
        {"chunk_bytes": 100},
        {"chunk_bytes": (32 << 20) + 1},
        {"transfer_timeout_s": 0},
        {"codec": ""},
    ],
)
def test_config_refuses_bad_values(bad):
    with pytest.raises(ConfigError):
        TransferConfig(**bad)


# -- bandwidth -------------------------------------------------------------


def test_estimator_starts_unknown_then_follows_an_ewma():
    estimator = BandwidthEstimator(alpha=0.5, clock=FakeClock())
    assert estimator.estimate("d1") is None
    estimator.observe("d1", 100 * MB, 1.0)
    assert estimator.estimate("d1") == 100 * MB
    estimator.observe("d1", 300 * MB, 1.0)
    assert estimator.estimate("d1") == 200 * MB
    assert estimator.estimate("d2") is None


def test_estimator_follows_a_changed_link_at_once():
    estimator = BandwidthEstimator(alpha=0.3, jump_factor=4.0, clock=FakeClock())
    estimator.observe("d1", 1000 * MB, 1.0)
    estimator.observe("d1", 300 * MB, 1.0)  # within the factor: averaged
    assert estimator.estimate("d1") == pytest.approx(790 * MB)
    estimator.observe("d1", 100 * MB, 1.0)  # a rate cut: replaces the estimate
    assert estimator.estimate("d1") == 100 * MB
    assert estimator.snapshot()["d1"]["samples"] == 1
    estimator.observe("d1", 500 * MB, 1.0)  # and back up
    assert estimator.estimate("d1") == 500 * MB


def test_estimator_ignores_latency_bound_samples():
    estimator = BandwidthEstimator(min_sample_bytes=1 * MB, clock=FakeClock())
    estimator.observe("d1", 1000, 0.000001)
    estimator.observe("d1", 10 * MB, 0.0)
    assert estimator.estimate("d1") is None


@pytest.mark.parametrize("side", [RECEIVER, SENDER])
def test_a_sample_paced_by_either_end_is_a_floor_on_the_link(side):
    estimator = BandwidthEstimator(clock=FakeClock())
    estimator.observe("d1", 10 * MB, 1.0, paced_by=side)  # the first: at least this
    assert estimator.estimate("d1") == 10 * MB and estimator.paced_by("d1") == side
    estimator.observe("d1", 1000 * MB, 1.0)  # the link set the pace: measured as ever
    assert estimator.estimate("d1") == 1000 * MB and estimator.paced_by("d1") == LINK
    estimator.observe("d1", 5 * MB, 1.0, paced_by=side)  # a starved end: no cut
    assert estimator.estimate("d1") == 1000 * MB and estimator.paced_by("d1") == side
    estimator.observe("d1", 3000 * MB, 1.0, paced_by=side)  # above it: raised
    assert estimator.estimate("d1") == 3000 * MB
    assert estimator.snapshot()["d1"]["paced_by"] == side
    estimator.observe("d1", 2000 * MB, 1.0)  # the link's pace again: replaces the bound
    assert estimator.estimate("d1") == 2000 * MB and estimator.paced_by("d1") == LINK
    assert estimator.paced_by("d2") == LINK


def test_estimator_forgets_stale_peers():
    clock = FakeClock()
    estimator = BandwidthEstimator(stale_after_s=60.0, clock=clock)
    estimator.observe("d1", 50 * MB, 1.0)
    clock.now += 30
    assert estimator.snapshot() == {"d1": {"bytes_per_s": 50 * MB, "samples": 1, "age_s": 30.0,
                                            "paced_by": LINK}}
    clock.now += 31
    assert estimator.estimate("d1") is None and estimator.snapshot() == {}
    estimator.observe("d1", 10 * MB, 1.0)  # a fresh start, not blended with the stale value
    assert estimator.estimate("d1") == 10 * MB


# -- selector --------------------------------------------------------------


def selector(**config) -> AdaptiveSelector:
    return AdaptiveSelector(TransferConfig(**config), STRATEGIES, CODECS)


def test_small_payload_goes_full_in_one_message_set():
    choice = selector().select(1 * MB, 400 * MB)
    assert (choice.strategy, choice.codec, choice.lanes) == ("full", "none", 1)


def test_large_payload_streams_to_overlap_prefill():
    choice = selector().select(200 * MB, 400 * MB)
    assert choice.strategy == "streamed" and choice.reason.startswith("overlap")


def test_large_payload_without_streaming_goes_full():
    assert selector().select(200 * MB, 400 * MB, can_stream=False).strategy == "full"


def test_several_links_and_a_long_wire_time_go_layer_parallel():
    choice = selector(parallelism=4).select(200 * MB, 400 * MB, lanes_available=3)
    assert (choice.strategy, choice.lanes) == ("layer-parallel", 3)


def test_a_short_wire_time_does_not_use_extra_links():
    tuning = SelectorTuning(small_payload_bytes=1 * MB, parallel_min_s=0.05)
    sel = AdaptiveSelector(TransferConfig(parallelism=4), STRATEGIES, CODECS, tuning)
    assert sel.select(8 * MB, 400 * MB, lanes_available=4).strategy == "streamed"


def test_fast_link_sends_raw_and_slow_link_compresses():
    fast = selector().select(200 * MB, 2000 * MB)
    slow = selector().select(200 * MB, 10 * MB)
    assert fast.codec == "none"
    assert slow.codec == "shuffle+lz4"
    assert slow.estimated_s["shuffle+lz4"] < slow.estimated_s["none"]


def test_a_receiver_paced_estimate_sends_raw_bytes_where_the_link_alone_would_compress():
    low_prior = AdaptiveSelector(TransferConfig(), STRATEGIES, CODECS,
                                 SelectorTuning(prior_bytes_per_s=1 * MB))
    paced = low_prior.select(200 * MB, 10 * MB, paced_by=RECEIVER)  # a floor above the prior
    assert paced.codec == "none" and paced.paced_by == RECEIVER
    assert paced.bandwidth_bytes_per_s == 10 * MB and paced.bandwidth_source == "measured"
    assert "receiver" in paced.reason
    assert paced.estimated_s["shuffle+lz4"] < paced.estimated_s["none"]  # what it set aside
    assert low_prior.select(200 * MB, 10 * MB).codec == "shuffle+lz4"  # read as the link's
    unmeasured = selector().select(200 * MB, None, paced_by=RECEIVER)  # nothing measured
    assert unmeasured.paced_by == LINK
    configured = selector(codec="lz4").select(200 * MB, 10 * MB, paced_by=RECEIVER)
    assert configured.codec == "lz4"


@pytest.mark.parametrize("side", [RECEIVER, SENDER])
def test_a_floor_below_the_prior_leaves_the_prior(side):
    paced = selector().select(200 * MB, 10 * MB, paced_by=side)
    prior = SelectorTuning().prior_bytes_per_s
    assert (paced.bandwidth_bytes_per_s, paced.bandwidth_source) == (prior, "prior")
    assert paced.paced_by == side and paced.codec == "none" and side in paced.reason


def test_lossy_codecs_only_when_allowed():
    tuning = SelectorTuning(auto_codecs=("none", "lz4", "int8", "int8+lz4"))
    strict = AdaptiveSelector(TransferConfig(), STRATEGIES, CODECS, tuning)
    strict = strict.select(200 * MB, 10 * MB)
    lossy = AdaptiveSelector(TransferConfig(allow_lossy=True), STRATEGIES, CODECS, tuning)
    assert "int8" not in strict.estimated_s and strict.codec in ("none", "lz4")
    assert lossy.select(200 * MB, 10 * MB).codec in ("int8", "int8+lz4")


def test_a_complete_cache_goes_whole_even_when_lanes_and_a_slow_wire_would_spread_it():
    choice = selector(parallelism=4).select(200 * MB, 10 * MB, lanes_available=4,
                                            can_stream=False)
    assert (choice.strategy, choice.lanes, choice.reason) == (
        "full", 1, f"cache already complete; codec {choice.codec} fastest by estimate")


def test_a_configured_streaming_strategy_sends_a_complete_cache_whole():
    for configured in ("streamed", "layer-parallel"):
        choice = selector(strategy=configured, parallelism=2).select(
            200 * MB, 400 * MB, lanes_available=2, can_stream=False)
        assert (choice.strategy, choice.lanes) == ("full", 1)
        assert choice.reason.startswith(f"cache already complete ({configured} streams)")


def test_explicit_config_overrides_the_estimate():
    choice = selector(strategy="full", codec="lz4").select(500 * MB, 2000 * MB)
    assert (choice.strategy, choice.codec) == ("full", "lz4")
    assert "configured" in choice.reason


def test_unknown_bandwidth_uses_the_prior():
    choice = selector().select(200 * MB, None)
    assert choice.bandwidth_source == "prior"
    assert choice.bandwidth_bytes_per_s == SelectorTuning().prior_bytes_per_s


def test_choice_is_deterministic_and_loggable():
    first = selector(parallelism=2).select(123 * MB, 77 * MB, lanes_available=2)
    again = selector(parallelism=2).select(123 * MB, 77 * MB, lanes_available=2)
    assert first == again
    logged = first.as_dict()
    assert set(logged) == {
        "strategy",
        "codec",
        "lanes",
        "reason",
        "payload_bytes",
        "bandwidth_bytes_per_s",
        "bandwidth_source",
        "estimated_s",
        "paced_by",
    }
    assert logged["bandwidth_source"] == "measured"


def test_a_measured_ratio_replaces_the_codec_profile():
    selector = AdaptiveSelector(TransferConfig(), STRATEGIES, CODECS)
    slow_link = 10 * MB
    assert selector.select(64 * MB, slow_link).codec == "shuffle+lz4"  # profile: 1.15x
    # What KV floats of a noisy model can give: nothing, so the codec only costs CPU.
    for _ in range(5):
        selector.observe_ratio("shuffle+lz4", 64 * MB, 64 * MB)
        selector.observe_ratio("lz4", 64 * MB, 64 * MB)
    assert selector.ratio(CODECS["shuffle+lz4"]) == pytest.approx(1.0, rel=0.01)
    assert selector.select(64 * MB, slow_link).codec == "none"


GBIT_BYTES_PER_S = 125 * MB


def test_with_lossy_allowed_int8_wins_on_1_gbit_and_raw_bytes_on_10():
    lossy = selector(allow_lossy=True)
    slow = lossy.select(90 * MB, GBIT_BYTES_PER_S)
    assert slow.codec == "int8" and slow.estimated_s["int8"] < slow.estimated_s["none"]
    assert lossy.select(90 * MB, 10 * GBIT_BYTES_PER_S).codec == "none"
    assert "int8" not in selector().select(90 * MB, GBIT_BYTES_PER_S).estimated_s


def test_a_codec_that_saves_little_is_not_worth_its_cpu():
    # At the prior (400 MB/s) shuffle+lz4's pipeline estimate is ~2% under raw bytes.
    choice = selector().select(90 * MB, None)
    assert choice.estimated_s["shuffle+lz4"] < choice.estimated_s["none"]
    assert choice.codec == "none"
    eager = SelectorTuning(min_codec_gain=0.0)
    assert AdaptiveSelector(TransferConfig(), STRATEGIES, CODECS, eager).select(
        90 * MB, None).codec == "shuffle+lz4"


def test_stages_overlap_chunk_by_chunk_so_the_slowest_sets_the_pace():
    choice = selector(chunk_bytes=8 * MB).select(80 * MB, 10 * MB)  # 10 chunks
    lz4 = CODECS["lz4"].profile
    stages = (80 * MB / lz4.encode_bytes_per_s, 80 * MB / lz4.ratio / (10 * MB),
              80 * MB / lz4.decode_bytes_per_s)
    assert choice.estimated_s["lz4"] == pytest.approx(
        max(stages) + (sum(stages) - max(stages)) / 10)
    assert choice.estimated_s["none"] == pytest.approx(8.0)


def test_measured_ratios_move_with_each_handoff_and_ignore_empty_ones():
    tuning = SelectorTuning(ratio_weight=0.5)
    selector = AdaptiveSelector(TransferConfig(), STRATEGIES, CODECS, tuning)
    selector.observe_ratio("lz4", 0, 10)  # nothing sent: no information
    assert selector.ratio(CODECS["lz4"]) == CODECS["lz4"].profile.ratio
    selector.observe_ratio("lz4", 200, 100)
    selector.observe_ratio("lz4", 100, 100)
    assert selector.ratio(CODECS["lz4"]) == pytest.approx(1.5)


# -- the selector picks from the strategies it is given ------------------------------


class BulkTransfer(FullTransfer):
    name = "bulk"


def scripted_strategy(options):  # declares no traits: never picked by "auto"
    return FullTransfer(options)


def test_strategies_are_picked_by_their_declared_traits_not_their_names():
    strategies = {"bulk": BulkTransfer, "trickle": StreamedTransfer}
    sel = AdaptiveSelector(TransferConfig(parallelism=4), strategies, CODECS)
    assert sel.select(1 * MB, 400 * MB).strategy == "bulk"
    # No lane-spreading strategy registered: extra links are not used.
    wide = sel.select(200 * MB, 10 * MB, lanes_available=4)
    assert (wide.strategy, wide.lanes) == ("trickle", 1)


def test_without_a_streaming_strategy_a_large_live_prefill_still_goes_whole():
    sel = AdaptiveSelector(TransferConfig(), {"full": FullTransfer}, CODECS)
    choice = sel.select(200 * MB, 400 * MB)
    assert (choice.strategy, choice.reason.split(";")[0]) == (
        "full", "no streaming strategy registered")


def test_of_two_strategies_of_one_kind_the_first_by_name_wins():
    strategies = {**STRATEGIES, "a-bulk": BulkTransfer}
    sel = AdaptiveSelector(TransferConfig(), strategies, CODECS)
    assert sel.select(1 * MB, 400 * MB).strategy == "a-bulk"
    assert sel.whole_cache_strategy == "a-bulk"


def test_a_factory_without_traits_is_used_only_when_configured():
    strategies = {**STRATEGIES, "aaa-scripted": scripted_strategy}
    assert AdaptiveSelector(TransferConfig(), strategies, CODECS).select(
        1 * MB, 400 * MB).strategy == "full"
    configured = AdaptiveSelector(TransferConfig(strategy="aaa-scripted"), strategies, CODECS)
    assert configured.select(1 * MB, 400 * MB).strategy == "aaa-scripted"
    # Whether it needs a live prefill is unknown, so a complete cache goes whole.
    assert configured.select(1 * MB, 400 * MB, can_stream=False).strategy == "full"


def test_an_unknown_configured_strategy_fails_listing_the_registered_ones():
    with pytest.raises(PluginError, match="registered: full, layer-parallel, streamed"):
        AdaptiveSelector(TransferConfig(strategy="bulk"), STRATEGIES, CODECS)


def test_a_registry_without_a_whole_cache_strategy_fails_at_construction():
    with pytest.raises(PluginError, match="complete cache: streamed"):
        AdaptiveSelector(TransferConfig(), {"streamed": StreamedTransfer}, CODECS)


def test_the_builtin_strategies_declare_their_traits():
    traits = {name: (f.overlaps_prefill, f.spreads_over_lanes) for name, f in STRATEGIES.items()}
    assert traits == {"full": (False, False), "streamed": (True, False),
                      "layer-parallel": (True, True)}
