"""What the embedded server loads: LoRA adapters into `Switch` layers, full weights in place.

`install_switches` puts a `Switch` in place of each LoRA target linear of the served model, so
any mix of adapters can run in one forward (one per batch row while decoding, one for the whole
input while prefilling). `read_adapter` reads a PEFT directory (as `lora.export_peft` writes it)
and `read_weights` a `save_pretrained` directory, each checked against the model before anything
is used: known names, the model's shapes, finite values, regular files under the allowed root.
A fault in what a client sent is an `ApiError` with vLLM's status (400 bad input, 404 nothing
there), which the server answers as JSON; an adapter's config is read with the API's JSON
checks (`api.number`, `api.refuse_constant`).
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import torch
from torch import nn

from reprorl.model.lora import (
    PEFT_CONFIG,
    PEFT_PREFIX,
    PEFT_WEIGHTS,
    TARGETS,
    with_adapter,
    with_row_adapters,
)

from .adapters import Adapter
from .api import number, refuse_constant
from .invariance import linear
from .sequence import ApiError

# ---------------------------------------------------------------- LoRA


class Switch(nn.Module):
    """A base linear layer plus adapters: one for the whole input (`active`, while one prompt
    is prefilled, `lora.with_adapter`), or one per batch row (`by_row`, while every slot
    decodes): each entry one adapter (`lora.with_adapter`) or a stack of them
    (`lora.with_row_adapters`, `adapters.stack_adapters`) over all rows, a fixed shape, whose
    result only its own rows keep."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base, self.active = base, None  # active: (A, B, scale) or None
        # [(weights: (A, B, scale) or a stack, rows: bool [slots, 1, 1] or None: all)]
        self.by_row: list = []
        self.columns = None  # (the weight's storage, (address, version), its copy)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """`base(x)`, bit for bit; in float32 on the CPU from a column-major copy of the
        weight (a second copy: 18.9 MB for the default model's projections) where
        `invariance.linear` finds that faster read gives the same bits (`benchmarks/columns.py`).
        The copy is made again when the weight changes: a full-weight reload copies into the
        parameter, which moves its version (a write through `.data` would not)."""
        weight = self.base.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or (
                weight.is_inference() or torch.is_grad_enabled() and weight.requires_grad):
            # no version to watch, or a gradient the detached copy would not pass on
            self.columns = None
            return self.base(x)
        stamp = (weight.data_ptr(), weight._version)
        columns = self.columns
        # the old storage is held, so no new weight can take its address
        if columns is None or columns[1] != stamp:
            columns = self.columns = (weight.untyped_storage(), stamp,
                                      weight.detach().t().contiguous())
        return linear(self.base, x, columns[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.product(x)
        for weights, rows in self.by_row:
            adapted = (with_adapter(result, x, *weights) if len(weights) == 3 else
                       with_row_adapters(result, x, *weights))
            result = adapted if rows is None else torch.where(rows, adapted, result)
        return result if self.active is None else with_adapter(result, x, *self.active)


def install_switches(model) -> dict[str, Switch]:
    """Put a `Switch` in place of each of the model's LoRA target linears; them by name."""
    switches = {}
    for name, module in list(model.named_modules()):
        if name.rpartition(".")[2] in TARGETS and isinstance(module, nn.Linear):
            parent, _, child = name.rpartition(".")
            switches[name] = Switch(module)
            setattr(model.get_submodule(parent), child, switches[name])
    return switches


ADAPTER_FILES = (PEFT_CONFIG, PEFT_WEIGHTS)


def adapter_files(name: str, path: str, root: Path | None) -> list[Path]:
    """The adapter's two files: under `root` (when the server was given one) and regular
    files, not links, so a client cannot make the server read anything else."""
    try:
        directory = Path(path).resolve()
    except (OSError, ValueError) as error:  # e.g. an embedded NUL byte
        raise ApiError(400, f"Loading lora {name} failed: {error}") from error
    if root is not None and not directory.is_relative_to(root):
        raise ApiError(400, f"Loading lora {name} failed: {path} is outside the adapter root "
                       f"{root} (--lora-root).")
    files = [directory / part for part in ADAPTER_FILES]
    for file in files:
        try:
            mode = os.lstat(file).st_mode
        except FileNotFoundError as error:  # vLLM's answer, status and words
            raise ApiError(404, f"Loading lora {name} failed: No adapter found for "
                           f"{path}") from error
        except (OSError, ValueError) as error:
            raise ApiError(400, f"Loading lora {name} failed: {error}") from error
        if not stat.S_ISREG(mode):
            raise ApiError(400, f"Loading lora {name} failed: {file} is not a regular file.")
    return files


def read_adapter(name: str, path: str, switches: dict[str, Switch], max_rank: int,
                 root: Path | None = None) -> Adapter:
    """A PEFT directory (as `reprorl.model.lora.export_peft` writes it) checked against the
    model."""
    from safetensors.torch import load_file

    config_file, weights_file = adapter_files(name, path, root)
    try:
        settings = json.loads(config_file.read_text(), parse_constant=refuse_constant)
        stored = load_file(weights_file)
        if not isinstance(settings, dict):
            raise ApiError(400, f"{PEFT_CONFIG} must hold an object")
        rank = number(settings, "r", None, int)
        alpha = number(settings, "lora_alpha", None)
    except ApiError as error:
        raise ApiError(400, f"Loading lora {name} failed: {error.message}") from error
    except Exception as error:  # unreadable or malformed: all the client's fault
        raise ApiError(400, f"Loading lora {name} failed: {error}") from error
    if rank is None or rank < 1 or alpha is None:
        raise ApiError(400, f"Loading lora {name} failed: {PEFT_CONFIG} needs 'r' >= 1 "
                       "and a finite 'lora_alpha'.")
    if rank > max_rank:
        raise ApiError(400, f"LoRA rank {rank} is greater than max_lora_rank {max_rank}.")
    if settings.get("use_dora"):
        raise ApiError(400, "DoRA adapters are not supported.")
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    pairs: dict[str, dict] = {}
    for key, tensor in stored.items():
        module, _, matrix = key.removeprefix(PEFT_PREFIX).removesuffix(".weight").rpartition(".")
        if not key.startswith(PEFT_PREFIX) or matrix not in ("lora_A", "lora_B") or (
                module not in switches):
            raise ApiError(400, f"While loading {path}, unexpected weight {key}")
        if not torch.isfinite(tensor).all():  # it would poison every batch it joins
            raise ApiError(400, f"Loading lora {name} failed: {key} holds NaN or Inf values.")
        device = switches[module].base.weight.device  # the served model's
        pairs.setdefault(module, {})[matrix] = tensor.float().contiguous().to(device)
    weights = {}
    for module, pair in pairs.items():
        a, b, base = pair.get("lora_A"), pair.get("lora_B"), switches[module].base
        if a is None or b is None or a.shape != (rank, base.in_features) or (
                b.shape != (base.out_features, rank)):
            raise ApiError(400, f"{path}: {module} lacks lora_A/lora_B or has wrong shapes")
        weights[module] = (a, b, scale)
    if not weights:
        raise ApiError(400, f"{path} holds no LoRA weights for this model")
    return Adapter(name, str(path), weights)


# ---------------------------------------------------------------- full weights


def weight_targets(model) -> dict[str, torch.Tensor]:
    """What a full checkpoint may hold, by its names: every parameter (tied twins both) and
    persistent buffer of `model` (`state_dict`'s names, the objects themselves)."""
    return dict(model.state_dict(keep_vars=True))


def read_weights(path: str, targets: dict[str, torch.Tensor], allowed: list[Path]
                 ) -> dict[str, torch.Tensor]:
    """The `*.safetensors` of a directory (as `save_pretrained` writes them) by `targets`'
    names (`weight_targets`), converted to their dtypes: each tensor known, of its target's
    shape, finite once converted; every parameter given (a tied one through its twin, which
    `save_pretrained` leaves out; twins given both must be equal). `allowed`: the directories
    the path may lie below (none: anywhere)."""
    from safetensors.torch import load_file

    try:
        directory = Path(path).resolve()
    except (OSError, ValueError) as error:
        raise ApiError(400, str(error)) from error
    if allowed and not any(directory.is_relative_to(root) for root in allowed):
        raise ApiError(400, f"{path} is outside the adapter root (--lora-root) "
                       "and is not the served model.")
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise ApiError(404, f"no *.safetensors weights found in {path}.")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if not stat.S_ISREG(os.lstat(file).st_mode):
            raise ApiError(400, f"{file} is not a regular file.")
        try:
            tensors.update(load_file(file))
        except Exception as error:  # unreadable: the client's file
            raise ApiError(400, f"{file}: {error}") from error
    given: dict[int, tuple[str, torch.Tensor]] = {}  # target object -> its first tensor
    for name, tensor in tensors.items():
        target = targets.get(name)
        if target is None:
            raise ApiError(400, f"{path} holds {name}, which this model lacks.")
        if tensor.shape != target.shape or tensor.is_floating_point() != (
                target.is_floating_point()):
            raise ApiError(400, f"{name} is {tensor.dtype} "
                           f"{tuple(tensor.shape)}, the model's {target.dtype} "
                           f"{tuple(target.shape)}.")
        tensors[name] = tensor = tensor.to(target.dtype)
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ApiError(400, f"{name} holds NaN or Inf values (in "
                           f"{target.dtype}).")
        twin = given.setdefault(id(target), (name, tensor))
        if twin[0] != name and not torch.equal(twin[1], tensor):
            raise ApiError(400, f"{name} and {twin[0]} are one tied weight "
                           "of this model but differ in the file.")
    missing = [name for name, target in targets.items()
               if isinstance(target, torch.nn.Parameter) and id(target) not in given]
    if missing:
        raise ApiError(400, f"{path} lacks {len(missing)} of the model's "
                       f"weights, e.g. {missing[0]}.")
    return tensors


def copy_weights(targets: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """`read_weights`' tensors into the model's own, in place (tied twins are one object)."""
    with torch.no_grad():
        for name, tensor in tensors.items():
            targets[name].copy_(tensor)
