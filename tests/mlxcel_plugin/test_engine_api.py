from dataclasses import asdict

from mlxcel_plugin.engine_api import SamplingParams


def test_sampling_params_to_dict_is_asdict_and_round_trips():
    params = SamplingParams(temperature=0.7, top_k=5, seed=11, logprobs=2, prompt_logprobs=0,
                            grammar='{"x": 1}', grammar_replay_tokens=3, speculative="ngram")
    assert params.to_dict() == asdict(params)
    assert list(params.to_dict()) == list(asdict(params))  # field order kept
    assert SamplingParams.from_dict(params.to_dict()) == params
