"""Logprobs and prompt logprobs through a real cluster, byte for byte a hybrid node's.

The fake engine's logprobs (a pure function) check the plumbing cheaply: the
first token's from the prefill node, the rest from decode, the prompt's with
the prefill node's first RESULT. The tiny MLX checkpoint checks the numbers,
and lm-eval's ``local-completions`` model scores a loglikelihood task (written
here, a local jsonl: no hub) the same against the router and the hybrid node.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from mlxcel_plugin.local_cluster import LocalCluster, start_node
from tests.integration.test_router_cluster import (
    MODEL,
    STARTUP_TIMEOUT_S,
    fake_model_dir,
    normalize,
    start_cluster,
)

pytestmark = pytest.mark.timeout(900)
STORY = [{"role": "user", "content": "Tell me about foxes."}]
CASES = [
    ("/v1/chat/completions", {"messages": STORY, "max_tokens": 12, "logprobs": True,
                              "top_logprobs": 5}),
    ("/v1/chat/completions", {"messages": STORY, "max_tokens": 12, "logprobs": True,
                              "top_logprobs": 20, "temperature": 0.8, "seed": 5,
                              "stream": True}),
    ("/v1/completions", {"prompt": "The fox jumps over", "max_tokens": 8, "logprobs": 5}),
    ("/v1/completions", {"prompt": "The fox jumps over", "max_tokens": 8, "logprobs": 2,
                         "stream": True}),
    ("/v1/completions", {"prompt": "The quick brown fox jumps over the lazy dog, again and "
                         "again.", "echo": True, "logprobs": 3, "max_tokens": 0}),
    ("/v1/completions", {"prompt": "A fox", "echo": True, "logprobs": 1, "max_tokens": 1}),
]


def concatenated(body: str) -> str:
    """A stream's chunks joined: batching differs between runs, the content may not."""
    if not body.startswith("data: "):
        return body
    chunks = [json.loads(line[6:]) for line in body.split("\n") if line.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices)
    logprobs: dict[str, list] = {}  # each chunk's lists, joined
    for part in (c["logprobs"] for c in choices if c.get("logprobs")):
        for key, values in part.items():
            logprobs.setdefault(key, []).extend(values)
    return json.dumps({"text": text, "logprobs": logprobs,
                       "finish": [c["finish_reason"] for c in choices if c["finish_reason"]]})


def bodies(url: str) -> list[str]:
    with httpx.Client(timeout=300) as http:
        out = []
        for path, body in CASES:
            r = http.post(f"{url}{path}", json={"model": MODEL, **body})
            assert r.status_code == 200, r.text
            out.append(concatenated(normalize(r.text)))
        return out


def hybrid_then_cluster(workdir: Path, model: str, engine: str, run) -> tuple:
    args = ["--engine", engine, "--model", model, "--served-model-name", MODEL, "--no-warmup"]
    hybrid = start_node("hybrid", workdir, args)
    try:
        hybrid.wait_healthy(STARTUP_TIMEOUT_S)
        expected = run(hybrid.url)
    finally:
        hybrid.stop()
    cluster: LocalCluster = start_cluster(workdir, model, engine=engine, prefill=1, decode=1)
    try:
        routed = run(cluster.router.url)
    finally:
        cluster.stop()
    return expected, routed


def test_fake_engine_cluster_reports_the_logprobs_hybrid_reports(tiny_model_path: Path,
                                                                  tmp_path) -> None:
    model = fake_model_dir(tmp_path / "model", tiny_model_path)
    expected, routed = hybrid_then_cluster(tmp_path, model, "fake", bodies)
    for case, want, got in zip(CASES, expected, routed, strict=True):
        assert got == want, case
    echoed = json.loads(expected[4])["choices"][0]["logprobs"]
    assert echoed["token_logprobs"][0] is None and None not in echoed["token_logprobs"][1:]


# -- the tiny MLX checkpoint, and lm-eval ------------------------------------------

TASK = "mlxcel_fox_ll"
DOCS = [
    {"question": "The fox jumps over the", "choices": [" dog", " moon", " lazy dog"],
     "answer": 2},
    {"question": "One, two,", "choices": [" three", " four"], "answer": 0},
    {"question": "Paris is the capital of", "choices": [" France", " Spain", " the"],
     "answer": 0},
    {"question": "Water is", "choices": [" wet", " dry"], "answer": 0},
]


def write_task(root: Path) -> Path:
    """A multiple-choice loglikelihood task over a local jsonl (HF datasets' json builder)."""
    root.mkdir(parents=True, exist_ok=True)
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (root / f"{TASK}.yaml").write_text(f"""\
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
""")
    return root


def lm_eval_scores(url: str, tokenizer: str, tasks_dir: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": MODEL, "base_url": f"{url}/v1/completions",
                    "tokenizer_backend": "huggingface", "tokenizer": tokenizer,
                    "num_concurrent": 1, "max_retries": 1, "tokenized_requests": True},
        # Only the task written here: indexing lm-eval's thousands of own tasks takes ~8 s.
        tasks=[TASK], task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
        log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
    )
    samples = [s["filtered_resps"] for s in results["samples"][TASK]]
    metrics = {k: v for k, v in results["results"][TASK].items() if not k.startswith("alias")}
    return {"metrics": metrics, "loglikelihoods": samples}


def test_tiny_checkpoint_logprobs_and_lm_eval_scores_match_hybrid(
        tiny_model_path: Path, tmp_path, monkeypatch) -> None:
    pytest.importorskip("lm_eval")  # in the test extra
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    tasks_dir = write_task(tmp_path / "tasks")

    def run(url: str) -> tuple[list[str], dict]:
        return bodies(url), lm_eval_scores(url, str(tiny_model_path), tasks_dir)

    (want_bodies, want_scores), (got_bodies, got_scores) = hybrid_then_cluster(
        tmp_path, str(tiny_model_path), "mlx", run)
    for case, want, got in zip(CASES, want_bodies, got_bodies, strict=True):
        assert got == want, case
    assert got_scores == want_scores
    print("lm-eval scores (router = hybrid):", json.dumps(got_scores["metrics"]))
    lls = [ll for doc in got_scores["loglikelihoods"] for ll, _ in doc]
    assert len(lls) == sum(len(d["choices"]) for d in DOCS) and all(ll < 0 for ll in lls)
