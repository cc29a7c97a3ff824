"""The device layer on a machine without a GPU: settings resolved or refused with the fix,
batches moved whole (and not copied on the CPU), GPU jobs declared only where a GPU is asked
for, and CPU runs left as they were (no CUDA entry in a state, no GPU memory in a manifest).
What only a GPU can show (BF16 on CUDA, exact resume there) is `benchmarks/gpu_check.sh`'s."""

import subprocess
import sys

import pytest
import torch

from reprorl.core import config as configuration
from reprorl.core import devices, stages
from reprorl.core.errors import ConfigError, ReproError
from reprorl.core.manifest import gpu_memory
from reprorl.core.state import restore_rng, rng_state
from reprorl.model.encoding import Example, collate

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


def test_cpu_and_auto_resolve_to_what_this_machine_has():
    assert devices.resolve("cpu") == torch.device("cpu")
    assert devices.resolve("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("setting", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda0", "", "mps"])
def test_a_setting_that_names_no_device_is_refused_by_schema_and_resolver(setting):
    with pytest.raises(ReproError, match=f"config key model.device: '{setting}' is not auto"):
        devices.resolve(setting)
    with pytest.raises(ConfigError, match="config key model.device: .* does not match"):
        configuration.validate({"model": {"device": setting}})


@no_gpu
@pytest.mark.parametrize("setting", ["cuda", "cuda:1"])
def test_a_gpu_asked_for_where_torch_sees_none_is_refused_with_the_fix(setting):
    with pytest.raises(ReproError, match=f"is '{setting}' but torch sees no CUDA GPU .*: ask "
                                         "for cpu, or install a CUDA build"):
        devices.prepare(setting)


@no_gpu
def test_the_server_refuses_a_gpu_it_cannot_see_before_loading_anything(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "reprorl", "serve", "--model", str(tmp_path / "absent"),
         "--device", "cuda"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "reprorl serve: error: --device is 'cuda' but torch sees no CUDA GPU (torch "
        f"{torch.__version__}, CUDA build {torch.version.cuda}): ask for cpu, or install a "
        "CUDA build of torch==2.13.0 and the [gpu] extra"]


def test_batches_move_whole_and_stay_themselves_where_they_are():
    batch = collate([Example("a", (1, 2), (3, 4)), Example("b", (5,), (6,))], pad_id=0)
    assert batch.to(torch.device("cpu")) is batch  # nothing copied on the CPU
    moved = batch.to(torch.device("meta"))
    assert moved is not batch and batch.input_ids.device.type == "cpu"
    assert all(getattr(moved, name).device.type == "meta" for name in vars(batch))
    assert moved.input_ids.shape == batch.input_ids.shape


def test_gpu_jobs_are_declared_only_for_model_stages_on_a_gpu():
    config = configuration.validate({})
    assert {stage: stages.gpus(stage, config) for stage in stages.STAGES} == dict.fromkeys(
        stages.STAGES, 0)
    for setting in ("cuda", "cuda:1"):
        config = configuration.validate({"model": {"device": setting},
                                         "grpo": {"nproc_per_node": 2}})
        assert stages.gpus("ppo_interrupt", config) == 1
        assert stages.gpus("grpo_learned_resume", config) == 2  # one per trainer rank
        assert stages.gpus("generate_sft", config) == stages.gpus("exercise", config) == 1
        for stage in ("prepare", "sft_resume_check", "evaluate", "report", "audit"):
            assert stages.gpus(stage, config) == 0, stage
    assert stages.gpus("ppo_interrupt", configuration.validate({"model": {"device": "auto"}}
                                                              )) == 0


def test_a_cpu_run_records_no_gpu_state():
    assert "cuda" not in rng_state() and "cuda" not in rng_state(torch.device("cpu"))
    if not torch.cuda.is_available():  # a process that never used CUDA
        assert gpu_memory() == {} and devices.memory() == {}


@no_gpu
def test_a_state_with_gpu_rngs_is_refused_where_no_gpu_is_seen():
    state = rng_state()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    with pytest.raises(ReproError, match="RNG states of 1 GPU.*resume it on the device kind"):
        restore_rng(state)
