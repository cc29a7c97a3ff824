"""Where a stage's tensors live: the config's `model.device` (auto, cpu, cuda or cuda:N).

CPU is the tested default and the one every published figure comes from. On CUDA the seed's
setting applies: a BF16-capable GPU (its `build_role` refuses any other), BF16 base weights
with FP32 adapters and heads (`model.dtype: bfloat16`; `roles.check_contract` checks it),
deterministic algorithms with cuBLAS's fixed workspace and no TF32, so a resumed run can end
bit for bit where a straight one does (CUDA RNG states are in every resume state:
`state.rng_state`). What may differ from the CPU is the bits themselves: a CUDA run equals
another CUDA run on the same GPU model, never a CPU run.

Generators follow the seed: data order, adapter and head initialisation draw on CPU
generators; token sampling draws on a generator of the device the logits are on
(`generator`). The rollout worker of a GRPO run stays on the CPU (it holds no model).
"""

from __future__ import annotations

import os
import re

import torch

from .errors import ReproError

SETTING = re.compile(r"auto|cpu|cuda(:\d+)?")
# cuBLAS's deterministic workspaces (NVIDIA's documented values); read when the first cuBLAS
# handle is made, so one is set before any CUDA work of the process (`prepare`)
CUBLAS_WORKSPACES = (":4096:8", ":16:8")


SETTING_NAME = "config key model.device"


def resolve(setting: str, what: str = SETTING_NAME) -> torch.device:
    """The device a setting names; `auto` is the first visible GPU if there is one. A GPU
    that is asked for and absent, or that lacks BF16, is refused with what to do instead;
    `what` names the setting in the message (`--device` for `reprorl serve`)."""
    if not isinstance(setting, str) or not SETTING.fullmatch(setting):
        raise ReproError(f"{what}: {setting!r} is not auto, cpu, cuda or cuda:N")
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(setting)
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        raise ReproError(f"{what} is {setting!r} but torch sees no CUDA GPU (torch "
                         f"{torch.__version__}, CUDA build {torch.version.cuda}): ask for cpu, "
                         "or install a CUDA build of torch==2.13.0 and the [gpu] extra")
    if device.index is not None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ReproError(f"{what}: {setting!r} would put every torchrun rank on one GPU: ask "
                         "for cuda (each rank takes cuda:LOCAL_RANK)")
    count = torch.cuda.device_count()
    index = device.index if device.index is not None else _local_rank()
    if index >= count:
        raise ReproError(f"{what}: {setting!r} asks for GPU {index} but "
                         f"{count} are visible (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    properties = torch.cuda.get_device_properties(index)
    if properties.major < 8:  # BF16 arithmetic from Ampere on
        raise ReproError(f"{properties.name} (GPU {index}, compute capability "
                         f"{properties.major}.{properties.minor}) has no BF16 support, which "
                         "the seed's GPU setting needs (BF16 base weights): use a GPU of "
                         "compute capability 8.0 or later, or ask for cpu")
    return torch.device("cuda", index)


def _local_rank() -> int:
    """Under torchrun each rank takes its own GPU: `cuda` means cuda:LOCAL_RANK."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def prepare(setting: str, what: str = SETTING_NAME) -> torch.device:
    """Resolve `setting` and make the process deterministic on it. Called once, before the
    stage builds anything (`cli.run_stage`, `reprorl serve`)."""
    torch.use_deterministic_algorithms(True)
    if setting != "cpu" and torch.cuda.is_available():  # before `resolve` initialises CUDA
        workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        if torch.cuda.is_initialized() and workspace not in CUBLAS_WORKSPACES:
            raise ReproError("CUDA was initialised before the deterministic cuBLAS workspace "
                             f"was set: export CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACES[0]}")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACES[0])
        if os.environ["CUBLAS_WORKSPACE_CONFIG"] not in CUBLAS_WORKSPACES:
            raise ReproError(f"CUBLAS_WORKSPACE_CONFIG={workspace} is not deterministic: "
                             f"set it to {' or '.join(CUBLAS_WORKSPACES)}, or unset it")
    device = resolve(setting, what)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    return device


def of(module: torch.nn.Module) -> torch.device:
    """The device of a module's parameters (a role, the policy, the served model)."""
    return next(module.parameters()).device


def generator(seed: int, device: torch.device) -> torch.Generator:
    """A sampling generator on `device` (where the logits it draws from are), seeded."""
    return torch.Generator(device=device).manual_seed(seed)


def memory() -> dict:
    """Peak GPU memory of this process (the seed's `max_memory_allocated/reserved`), for a
    manifest's run section beside the peak RSS; empty when the process never used CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    device = torch.cuda.current_device()
    return {"device": torch.cuda.get_device_name(device),
            "gpu_peak_allocated_mb": round(torch.cuda.max_memory_allocated(device) / 2**20, 1),
            "gpu_peak_reserved_mb": round(torch.cuda.max_memory_reserved(device) / 2**20, 1)}


def cuda_rng_states(device: torch.device) -> list[torch.Tensor] | None:
    """Every GPU's RNG state, for a resume state of a run on `device`; None on the CPU (a CPU
    run's state is the same on a host with GPUs)."""
    return torch.cuda.get_rng_state_all() if device.type == "cuda" else None


def restore_cuda_rng(states: list[torch.Tensor]) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < len(states):
        raise ReproError(f"this state holds the RNG states of {len(states)} GPU(s), which this "
                         "process does not see: resume it on the device kind that wrote it "
                         "(model.device)")
    torch.cuda.set_rng_state_all(states)


def synchronize() -> None:
    """Wait for queued GPU work before reading a clock (a no-op on the CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
