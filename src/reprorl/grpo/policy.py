"""The policy the trainer trains: loaded, made trainable, saved and restored.

`load_policy` takes a model object or a local path; `make_trainable` gives it what it trains:
a fresh LoRA of `lora_rank` on every projection (or a `peft_config`'s r and lora_alpha, or a
PEFT adapter from `lora_path`), or, with `use_peft=False`, every weight of the model. A LoRA is
saved as a PEFT adapter (`lora.export_peft`), full weights as `save_pretrained` writes them
(`save_full`), which is what the generation server reloads. Training mode is the seed's:
dropout off, activation checkpointing as the config says.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from reprorl.core.manifest import atomic_directory
from reprorl.model import lora
from reprorl.serve.sequence import ApiError
from reprorl.serve.weights import copy_weights, read_weights, weight_targets

from .config import AsyncGRPOConfig


def disable_dropout(model) -> None:
    """Training mode (gradient checkpointing needs it) without dropout's noise, as TRL does."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def checkpointing(model, on: bool) -> None:
    """Activation (gradient) checkpointing on or off; transformers 5 renamed the methods."""
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def checkpointing_on(model) -> bool:
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


@contextlib.contextmanager
def training_mode(model, gradient_checkpointing: bool):
    """The seed's training mode while the block runs: dropout off, checkpointing as asked, and
    `model.train()` only with checkpointing (HF checkpoints in training mode only); the
    caller's model gets its mode and checkpointing back after, whatever happens."""
    was_training, was_checkpointing = model.training, checkpointing_on(model)
    disable_dropout(model)
    checkpointing(model, gradient_checkpointing)
    model.train(gradient_checkpointing)
    try:
        yield model
    finally:
        checkpointing(model, was_checkpointing)
        model.train(was_training)


# The LoRA this engine trains (`lora.inject`): PEFT's defaults, on every projection. A
# peft_config's r and lora_alpha are honoured; any other field must have this value.
PEFT_AS_TRAINED = {
    "peft_type": "LORA", "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
    "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
    "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
    "alpha_pattern": {}, "fan_in_fan_out": False, "exclude_modules": None,
    "trainable_token_indices": None, "lora_bias": False, "layer_replication": None,
    "target_parameters": None, "use_qalora": False,
}


def refuse_unsupported_peft(peft_config) -> None:
    """Raise ValueError naming each field of `peft_config` (PEFT's LoraConfig) that the
    engine would not honour; its target_modules must be the seven projections."""
    if peft_config is None:
        return
    problems = []
    for name, wanted in PEFT_AS_TRAINED.items():
        value = getattr(peft_config, name, wanted)
        value = getattr(value, "value", value)  # PeftType.LORA -> "LORA"
        if (value or None) != (wanted or None) and value != wanted:
            problems.append(f"{name}={value!r} (supported: {wanted!r})")
    targets = getattr(peft_config, "target_modules", None)
    if targets != "all-linear" and (
            isinstance(targets, str) or set(targets or ()) != set(lora.TARGETS)):
        problems.append(f"target_modules={targets!r} (supported: 'all-linear' or the seven "
                        f"projections {list(lora.TARGETS)}; None would let PEFT pick the "
                        "model type's default, q_proj and v_proj for Qwen2)")
    if problems:
        raise ValueError("peft_config: " + "; ".join(problems) + ". This engine trains a LoRA "
                         "of rank r and lora_alpha on every projection with PEFT's other "
                         "defaults: drop those fields or set them as said")


def lora_settings(model) -> tuple[int, float] | None:
    for module in model.modules():
        if isinstance(module, lora.LoRALinear):
            return module.rank, module.alpha
    return None


def save_full(model, directory: Path) -> None:
    """The whole policy as `save_pretrained` writes it (what vLLM reloads), atomically."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar per sync would flood the run's log
    try:
        with atomic_directory(directory) as scratch:
            model.save_pretrained(scratch)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def load_full_into(model, directory: Path) -> None:
    """Weights written by `save_full`, checked against the model as the server checks them."""
    targets = weight_targets(model)
    try:
        tensors = read_weights(str(directory), targets, [])
    except ApiError as error:
        raise ValueError(f"checkpoint {directory}: {error.message}") from error
    copy_weights(targets, tensors)


def refuse_full_with_adapter(model, peft_config, lora_path) -> None:
    """use_peft=False trains the model's own weights: an adapter anywhere is a contradiction."""
    given = [what for what, there in (("peft_config", peft_config is not None),
                                      ("lora_path", lora_path is not None),
                                      ("a model with LoRA layers", lora_settings(model)))
             if there]
    if given:
        raise ValueError(f"use_peft=False trains the full model, but {' and '.join(given)} "
                         "was given: drop it, or set use_peft=True to train a LoRA adapter")


def load_policy(model, args: AsyncGRPOConfig):
    """A model object as given, or a path loaded with the config's dtype and init kwargs;
    returns (model, its path)."""
    if not isinstance(model, str):
        return model, str(model.name_or_path)
    from transformers import AutoModelForCausalLM

    kwargs = dict(args.model_init_kwargs or {})
    kwargs.setdefault("dtype", args.dtype if args.dtype == "auto" else getattr(torch, args.dtype))
    return AutoModelForCausalLM.from_pretrained(
        model, local_files_only=True, trust_remote_code=args.trust_remote_code, **kwargs), model


def make_trainable(model, args: AsyncGRPOConfig, peft_config, lora_path
                   ) -> tuple[int, float] | tuple[None, None]:
    """Mark what trains, and return the LoRA's (rank, alpha), or (None, None) for the full
    model. A model that already carries LoRA layers keeps them (and the rank it has)."""
    if not args.use_peft:
        refuse_full_with_adapter(model, peft_config, lora_path)
        for parameter in model.parameters():  # the full model: every weight trains
            parameter.requires_grad_(True)
        return None, None
    if lora_settings(model) is None:  # a fresh adapter: peft_config's r, else the config's
        refuse_unsupported_peft(peft_config)
        rank = getattr(peft_config, "r", args.lora_rank)
        alpha = getattr(peft_config, "lora_alpha", args.lora_alpha)
        lora.inject(model, rank, alpha, args.seed)
    if lora_path is not None:
        lora.load_peft_into(model, lora_path)
    return lora_settings(model)
