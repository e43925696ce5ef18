"""The reuse probe's answer kept on disk: a second start skips the probe, a changed key
re-probes, a corrupt file is ignored with one log line. Every cache here lives in tmp_path."""

from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engines.mlx_engine import MlxEngine
from engines.prefix import probe_cache, reuse_probe
from mlxcel_plugin import openblas
from mlxcel_plugin.engine_api import EngineConfig, ModelInfo, PrefixCacheConfig

KEY = {"format": probe_cache.FORMAT, "checkpoint": "abc", "blas": [{"core": "SkylakeX"}]}


@pytest.fixture
def probes(monkeypatch, tmp_path) -> list[int | None]:
    """The probe's real answers, one per run, with the cache pointed at tmp_path."""
    monkeypatch.setenv(probe_cache.CACHE_DIR_VAR, str(tmp_path / "probe-cache"))
    monkeypatch.delenv(probe_cache.DISABLE_VAR, raising=False)
    answers: list[int | None] = []
    real = reuse_probe.probe_min_rows

    def counted(*args, **kwargs):
        answers.append(real(*args, **kwargs))
        return answers[-1]

    monkeypatch.setattr(reuse_probe, "probe_min_rows", counted)
    return answers


def _start(model_path, **config) -> int:
    engine = MlxEngine.from_path(str(model_path), EngineConfig(warmup=False, **config))
    engine.start()
    try:
        return engine.stats().prefix_cache.exact_min_rows
    finally:
        engine.close()


def test_a_second_engine_start_reuses_the_probe_answer(tiny_model_path, tmp_path, probes):
    first = _start(tiny_model_path)
    second = _start(tiny_model_path)
    assert len(probes) == 1
    assert first == second == (probes[0] or 0)
    files = sorted(os.listdir(tmp_path / "probe-cache"))
    assert len(files) == 2 and files[0].endswith(".json")  # no temporary file left behind
    assert files[1] == files[0].replace(".json", ".lock")  # the probers' lock, kept


def test_a_changed_key_probes_again(tiny_model_path, probes, monkeypatch):
    _start(tiny_model_path)
    _start(tiny_model_path, chunk_size_tokens=64)  # another engine setting
    assert len(probes) == 2
    other = {"path": "/lib/libopenblas.so", "version": "0.3.21", "core": "Haswell", "threads": 2,
             "l2_size": ""}
    real = openblas.blas_in_process
    monkeypatch.setattr(openblas, "blas_in_process",
                        lambda: [{**lib, "core": "Haswell"} for lib in real()] or [other])
    _start(tiny_model_path)  # another BLAS core type
    assert len(probes) == 3
    _start(tiny_model_path)
    assert len(probes) == 3


def test_chunk_granularity_neither_probes_nor_reads_the_cache(tiny_model_path, probes):
    _start(tiny_model_path, prefix_cache=PrefixCacheConfig(granularity="chunk"))
    assert probes == []


@pytest.mark.parametrize("body", ["{not json", json.dumps({"key": KEY, "min_rows": "8"}),
                                  json.dumps({"key": KEY}), json.dumps([1, 2]), ""])
def test_a_corrupt_file_is_ignored_with_one_log_line(tmp_path, caplog, body):
    runs = []
    probe = lambda: runs.append(1) or 16  # noqa: E731
    assert probe_cache.remembered(KEY, probe, tmp_path) == 16
    (path,) = tmp_path.glob("*.json")
    path.write_text(body)
    with caplog.at_level(logging.INFO, logger=probe_cache.__name__):
        assert probe_cache.remembered(KEY, probe, tmp_path) == 16
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(runs) == 2 and len(warnings) == 1 and str(path) in warnings[0].getMessage()
    assert json.loads(path.read_text()) == {"key": KEY, "min_rows": 16}  # rewritten whole
    assert probe_cache.remembered(KEY, probe, tmp_path) == 16
    assert len(runs) == 2


def test_whole_cells_are_remembered_too(tmp_path):
    runs = []
    assert probe_cache.remembered(KEY, lambda: runs.append(1), tmp_path) is None
    assert probe_cache.remembered(KEY, lambda: runs.append(1), tmp_path) is None
    assert len(runs) == 1


def test_starts_at_once_probe_once_and_share_the_answer(tmp_path):
    """Threads stand in for nodes: each open() of the lock file is its own flock holder."""
    inside, most_inside, runs = [0], [0], []

    def probe() -> int:
        inside[0] += 1
        most_inside[0] = max(most_inside[0], inside[0])
        time.sleep(0.05)  # the others reach the lock while this one probes
        runs.append(1)
        inside[0] -= 1
        return 16

    with ThreadPoolExecutor(4) as starts:
        answers = list(starts.map(lambda _: probe_cache.remembered(KEY, probe, tmp_path),
                                  range(4)))
    assert answers == [16] * 4
    assert (len(runs), most_inside[0]) == (1, 1)


def test_an_unwritable_directory_still_gives_the_answer(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger=probe_cache.__name__):
        assert probe_cache.remembered(KEY, lambda: 8, blocker / "cache") == 8
    assert len(caplog.records) == 1


def test_where_the_cache_lives():
    assert probe_cache.cache_dir({}) == Path.home() / ".cache" / "mlxcel" / "reuse-probe"
    assert str(probe_cache.cache_dir({"XDG_CACHE_HOME": "/x"})) == "/x/mlxcel/reuse-probe"
    assert str(probe_cache.cache_dir({"XDG_CACHE_HOME": "/x", "MLXCEL_CACHE_DIR": "/m"})) == \
        "/m/reuse-probe"
    assert str(probe_cache.cache_dir({"MLXCEL_CACHE_DIR": "/m", "MLXCEL_PROBE_CACHE_DIR": "/p"})) \
        == "/p"
    assert probe_cache.cache_dir({"MLXCEL_PROBE_CACHE_DIR": "/p",
                                  "MLXCEL_NO_PROBE_CACHE": "1"}) is None


def test_the_disabled_cache_probes_every_time(tmp_path, monkeypatch):
    monkeypatch.setenv(probe_cache.DISABLE_VAR, "1")
    runs = []
    for _ in range(2):
        probe_cache.remembered(KEY, lambda: runs.append(1) or 8)
    assert len(runs) == 2


def test_the_checkpoint_digest_follows_config_and_weights(tmp_path):
    assert probe_cache.checkpoint_digest(tmp_path) is None
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    weights = tmp_path / "model.safetensors"
    header = b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'
    weights.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    os.utime(weights, ns=(10**18, 10**18))
    first = probe_cache.checkpoint_digest(tmp_path)
    assert probe_cache.checkpoint_digest(tmp_path) == first
    os.utime(weights, ns=(10**18, 10**18 + 1))  # rewritten in place
    assert probe_cache.checkpoint_digest(tmp_path) != first
    os.utime(weights, ns=(10**18, 10**18))
    (tmp_path / "config.json").write_text('{"hidden_size": 128}')
    assert probe_cache.checkpoint_digest(tmp_path) != first


def test_a_model_without_a_checkpoint_directory_is_probed_uncached(tmp_path):
    info = ModelInfo("toy", {}, 4096, (0,), 100)  # no tokenizer_dir: nothing to name it by
    assert probe_cache.probe_key(EngineConfig(), info, {}) is None
