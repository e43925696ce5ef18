"""A model whose cache class has no handoff form, through real router + prefill + decode.

Each node process imports a ``sitecustomize`` that makes every prompt cache
a ``MysteryCache`` (a ``KVCache`` by another name, as a newer mlx-lm's class
would look to this one). Hybrid serving works; a routed request must get an
OpenAI-shaped 501 naming the class (not a 500, not a generic "KV handoff
failed"), and the prefill node must keep serving.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from mlxcel_plugin.local_cluster import LocalCluster
from tests.integration.test_arch_matrix_cluster import MODEL, STARTUP_TIMEOUT_S

pytestmark = pytest.mark.timeout(600)

SITECUSTOMIZE = '''
from mlx_lm.models import cache as _cache

import engines.cache_layout as _layout
import engines.prefill as _prefill


class MysteryCache(_cache.KVCache):
    pass


def _mystery_caches(model, *args, **kwargs):
    return [MysteryCache() for _ in model.layers]


_layout.make_prompt_cache = _mystery_caches
_prefill.make_prompt_cache = _mystery_caches
'''


def test_a_cache_class_without_a_handoff_form_is_a_501_naming_it(tmp_path: Path,
                                                                 tiny_model_path: Path):
    patch = tmp_path / "patch"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {"PYTHONPATH": os.pathsep.join([str(patch), os.environ.get("PYTHONPATH", "")])}
    toml = tmp_path / "cluster.toml"
    toml.write_text("[prefix_cache]\nlocal_prefill_tokens = 0\n")
    cluster = LocalCluster(workdir=tmp_path, model=str(tiny_model_path), env=env, common_args=[
        "--served-model-name", MODEL, "--no-warmup", "--distributed-config", str(toml)])
    cluster.start(STARTUP_TIMEOUT_S)
    try:
        body = {"model": MODEL, "prompt": "the fox ran over the hill", "max_tokens": 4}
        with httpx.Client(timeout=120) as http:
            answers = [http.post(f"{cluster.router.url}/v1/completions", json=body)
                       for _ in range(2)]  # the second: the nodes still serve
            prefill = cluster.pool("prefill")[0]
            health = http.get(f"{prefill.url}/health").json()
        logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("prefill-*.log"))
    finally:
        cluster.stop()
    for answer in answers:
        assert answer.status_code == 501, answer.text
        error = answer.json()["error"]
        assert error["code"] == "cache_not_transferable"
        assert error["type"] == "not_implemented_error"
        assert "MysteryCache" in error["message"]
    assert health["status"] == "ok"
    assert "cannot run disaggregated" in logs and "MysteryCache" in logs
