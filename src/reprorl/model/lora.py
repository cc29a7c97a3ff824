"""Explicit LoRA: `W x + (alpha / r) * B(A x)`, and its export in PEFT's format.

The adapter branch runs in FP32 whatever the base dtype, and the sum is cast back to the base
dtype, as PEFT does. A is Kaiming-uniform from a seeded generator (PEFT's default init with its
`a=sqrt(5)`), B starts at zero, so a fresh adapter leaves the base function unchanged. PEFT is
used only as an oracle in the tests and as the export format (so vLLM and `peft` load our
adapters); it never trains anything here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from reprorl.core.errors import ReproError
from reprorl.core.manifest import atomic_directory, atomic_write_bytes, write_json

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."
# a PEFT adapter folder, as peft's save_pretrained writes it and vLLM loads it
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable FP32 low-rank update."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        if not isinstance(base, nn.Linear) or rank < 1 or alpha <= 0:
            raise ReproError("LoRA needs an nn.Linear base, rank >= 1 and alpha > 0")
        self.base = base.requires_grad_(False)
        device = base.weight.device
        # drawn where the generator is (the CPU: the same A on any device), then moved
        a = torch.empty(rank, base.in_features, device="meta" if device.type == "meta" else
                        generator.device)
        if device.type != "meta":
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_A = nn.Parameter(a.to(device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=device))
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return with_adapter(self.base(x), x, self.lora_A, self.lora_B, self.scale)


def with_adapter(result: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """`result + scale * B(A x)`, `result` being the base layer's `W x`: the branch in FP32,
    the sum cast back to the base dtype (PEFT's rule). The trainer's `LoRALinear` and the
    generation server's per-adapter layers both compute it here."""
    delta = nn.functional.linear(nn.functional.linear(x.float(), a), b)
    return (result.float() + scale * delta).to(result.dtype)


def with_row_adapters(result: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      pick: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`with_adapter` for a batch whose rows use different adapters, all in one batched
    product: `a` [n, in, r] and `b` [n, r, out] stack n adapters' A^T and B^T; row i takes
    row `pick[i]` of the [n x rows, out] results (its adapter's place x rows + i), scaled by
    `scale[i]` [rows, 1, 1], its alpha / r. A row with none of these adapters must keep
    `result` through the caller's mask: its scale 0 would meet another adapter's product,
    and 0 x Inf is NaN. Every adapter runs over all the rows, one item of `bmm` each: two
    kernel calls whatever n is. On the CPU with one torch thread an item is bitwise what
    `with_adapter`'s two products give (`tests/test_lora.py`, `invariance.rows_invariant`); with
    more threads it may not be, and may depend on n."""
    rows = x.shape[0]
    inputs = x.float().reshape(1, rows, -1).expand(a.shape[0], rows, -1)
    delta = torch.bmm(torch.bmm(inputs, a), b).flatten(0, 1).index_select(0, pick)
    return (result.float() + scale * delta.view(result.shape)).to(result.dtype)


def inject(model: nn.Module, rank: int, alpha: float, seed: int) -> int:
    """Wrap every target projection of every layer, freeze everything else, and return the
    adapter parameter count.

    Adapters are created in sorted module-name order from one generator, so the same seed gives
    the same A matrices on any machine.
    """
    found = targets(model)
    generator = torch.Generator().manual_seed(seed)
    for name in sorted(found):
        parent, _, child = name.rpartition(".")
        wrapped = LoRALinear(found[name], rank, alpha, generator)
        setattr(model.get_submodule(parent), child, wrapped)
    for name, parameter in model.named_parameters():  # the whole base is frozen, not just W
        parameter.requires_grad_(is_adapter(name))
    return sum(p.numel() for n, p in model.named_parameters() if is_adapter(n))


def targets(model: nn.Module) -> dict[str, nn.Linear]:
    """Every projection an adapter wraps, by module name; a model whose layers lack one is
    refused, naming what is missing (the base_model stage asks before any role is built)."""
    found = {n: m for n, m in model.named_modules() if n.rpartition(".")[2] in TARGETS}
    layers = model.config.num_hidden_layers
    if len(found) != layers * len(TARGETS) or not all(
            isinstance(m, nn.Linear) for m in found.values()):
        # a family whose layers are not Llama's or Qwen2's (GPT-2's fused c_attn, say)
        present = {n.rpartition(".")[2] for n, m in found.items() if isinstance(m, nn.Linear)}
        missing = [t for t in TARGETS if t not in present] or ["one per layer of each"]
        raise ReproError(
            f"model type {model.config.model_type!r} cannot take this project's adapters: its "
            f"{layers} layers lack the linear projections {', '.join(missing)} (found "
            f"{len(found)} of {layers * len(TARGETS)}); the roles support Llama- and "
            "Qwen2-family causal LMs")
    return found


def is_adapter(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def expected_parameter_count(config, rank: int) -> int:
    """r * (in + out) summed over the seven projections of every layer."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    q = config.num_attention_heads * head_dim
    shapes = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden),
              (hidden, inter), (hidden, inter), (inter, hidden)]
    return config.num_hidden_layers * rank * sum(a + b for a, b in shapes)


# ---------------------------------------------------------------- PEFT format


def peft_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter tensors under PEFT's names (`...q_proj.lora_A.weight`)."""
    state = {}
    for name, parameter in model.named_parameters():
        if is_adapter(name):
            module, _, matrix = name.rpartition(".")
            state[f"{PEFT_PREFIX}{module}.{matrix}.weight"] = parameter.detach().cpu().contiguous()
    return state


def export_peft(model: nn.Module, directory: str | Path, base_path: str, rank: int,
                alpha: float) -> Path:
    """Write `adapter_config.json` + `adapter_model.safetensors` (atomically, file by file)."""
    from safetensors.torch import save

    directory = Path(directory)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_path),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(TARGETS),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    with atomic_directory(directory) as scratch:  # both files appear together or not at all
        atomic_write_bytes(scratch / PEFT_WEIGHTS, save(peft_state(model)))
        write_json(scratch / PEFT_CONFIG, config)
    return directory


def load_peft_into(model: nn.Module, directory: str | Path) -> None:
    """Copy a PEFT-format adapter into a model that already has our LoRA layers."""
    from safetensors.torch import load_file

    directory = Path(directory)
    settings = json.loads((directory / PEFT_CONFIG).read_text())
    stored = load_file(directory / PEFT_WEIGHTS)
    ours = peft_state(model)
    if set(stored) != set(ours):
        raise ReproError(f"{directory} adapters do not match this model's LoRA layers")
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for key, tensor in stored.items():
            module, matrix = key.removeprefix(PEFT_PREFIX).rsplit(".", 2)[:2]
            target = parameters[f"{module}.{matrix}"]
            if target.shape != tensor.shape:
                raise ReproError(f"{key}: shape {list(tensor.shape)} != {list(target.shape)}")
            target.copy_(tensor)
    for module in model.modules():
        if isinstance(module, LoRALinear) and (
            module.rank != settings["r"] or module.alpha != settings["lora_alpha"]
        ):
            raise ReproError(f"{directory} has r={settings['r']}, alpha={settings['lora_alpha']}")
