"""Each model starts with sensible sampling: its file's recommendation, the measured
setting for the bundled model, or general defaults with a mild repetition penalty."""

from __future__ import annotations

import json

from conftest import run_cli

from engine.sampling import (
    BUNDLED_MODEL_DEFAULTS,
    FROM_GENERIC,
    FROM_MEASUREMENT,
    FROM_MODEL_FILE,
    GENERIC_DEFAULTS,
    defaults_for_model,
    defaults_for_model_file,
    model_defaults,
)


def test_recommendations_in_the_file_win_key_by_key():
    got, source = model_defaults({"general.sampling.temp": 0.6, "general.sampling.top_k": 20,
                                  "general.sampling.top_p": "0.5",        # not a number: ignored
                                  "general.sampling.min_p": 250.0})        # out of range: ignored
    assert source == FROM_MODEL_FILE
    assert (got.temperature, got.top_k) == (0.6, 20)
    assert (got.top_p, got.min_p, got.repeat_penalty) == (GENERIC_DEFAULTS.top_p, GENERIC_DEFAULTS.min_p,
                                                           GENERIC_DEFAULTS.repeat_penalty)
    assert model_defaults({}) == (GENERIC_DEFAULTS, FROM_GENERIC)
    assert GENERIC_DEFAULTS.repeat_penalty > 1.0                        # a mild penalty


def test_the_bundled_model_uses_what_was_measured_and_the_checkpoint_records_it(smollm_path, gemma_path,
                                                                              tmp_path):
    assert defaults_for_model_file(smollm_path) == (BUNDLED_MODEL_DEFAULTS, FROM_MEASUREMENT)
    assert defaults_for_model_file(gemma_path)[0].repeat_penalty > 1.0
    saved = tmp_path / "s.kvckpt"
    run_cli("run", "-p", "Hi", "-n", "2", "--ctx-size", "512", "--checkpoint-save", str(saved), check=True)
    sampler = json.loads(run_cli("inspect", str(saved), "--json", check=True).stdout)[
        "metadata"]["conversation"]["sampler"]
    assert (sampler["temperature"], sampler["top_p"], sampler["repeat_penalty"]) == (0.7, 0.9, 1.1)
    run_cli("run", "-p", "Hi", "-n", "2", "--ctx-size", "512", "--temp", "0.3",
            "--checkpoint-save", str(saved), check=True)
    sampler = json.loads(run_cli("inspect", str(saved), "--json", check=True).stdout)[
        "metadata"]["conversation"]["sampler"]
    assert sampler["temperature"] == 0.3 and sampler["repeat_penalty"] == 1.1


def test_a_loaded_models_defaults_come_from_llama_cpps_metadata_and_agree_with_the_file(smollm_path, gemma_path):
    from native.model import Model

    class Meta:   # a loaded model whose file recommends a sampler (llama.cpp gives strings)
        path = gemma_path
        values = {"general.sampling.temp": "0.6", "general.sampling.top_k": "20",
                  "general.sampling.top_p": "high"}

        def meta(self, key):
            return self.values.get(key)

    got, source = defaults_for_model(Meta())
    assert source == FROM_MODEL_FILE and (got.temperature, got.top_k) == (0.6, 20)
    assert got.top_p == GENERIC_DEFAULTS.top_p                       # not a number: ignored
    for path in (smollm_path, gemma_path):
        with Model(path) as model:
            assert defaults_for_model(model) == defaults_for_model_file(path)
