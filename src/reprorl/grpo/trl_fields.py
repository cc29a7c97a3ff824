"""The fields of TRL 1.16's `AsyncGRPOConfig` this trainer does not read, each with its answer.

A TRL user's script passes them; each is a field of `AsyncGRPOConfig` too, at TRL's default, so
the script runs and reads them back. A value this trainer does not honour is refused when the
config is built, naming the field and why (`problems`), never ignored:
- `NOT_READ` (by reason; `UNREAD` by field): accepted at its default and at the values of
  `ALSO` (what this trainer does anyway), refused at any other.
- `RENAMED`: TRL 1.16's name for a field of ours (the source document's name): either is
  accepted; both at once must agree.
`tests/test_grpo_config.py` checks the installed TRL's field list against these and the
config's own fields: a field that is in none fails it. docs/grpo.md lists the departures.
"""

from __future__ import annotations

from dataclasses import field, fields, make_dataclass
from typing import Any

ANY = "any value"  # read by scripts and launchers, not by the trainer (as in transformers)

# reasons shared by several fields
NO_EVAL = "evaluation is not implemented (no eval_dataset)"
NO_HUB = "no model hub: pushing checkpoints is not implemented"
NO_SPACES = "no model hub: trackio logs locally, a Space cannot be created"
NO_LOADER = "samples come from the rollout queue, not a DataLoader"
DDP = ("ranks run under torchrun and average gradients with their own all-reduce "
       "(distributed.py), not accelerate, FSDP, DeepSpeed or torch's DDP wrapper")
NO_COMPILE = "torch.compile is not applied to the policy"

# why -> {field: its default here}: each accepted at that default (what the trainer does
# anyway; TRL's default but for logging_nan_inf_filter) and at the values of ALSO, refused at
# any other
NOT_READ: dict[str, dict[str, Any]] = {
    NO_EVAL: dict(
        eval_strategy="no", eval_steps=None, eval_delay=0, eval_on_start=False,
        per_device_eval_batch_size=8, eval_accumulation_steps=None, eval_do_concat_batches=True,
        eval_use_gather_object=False, prediction_loss_only=False, include_for_metrics=[],
        batch_eval_metrics=False, bf16_full_eval=False, fp16_full_eval=False,
        load_best_model_at_end=False, metric_for_best_model=None, greater_is_better=None),
    NO_HUB: dict(push_to_hub=False, hub_token=None, hub_private_repo=None, hub_model_id=None,
                 hub_strategy="every_save", hub_always_push=False, hub_revision=None),
    NO_SPACES: dict(trackio_space_id=None, trackio_bucket_id=None, trackio_static_space_id=None),
    NO_LOADER: dict(dataloader_drop_last=False, dataloader_num_workers=0,
                    dataloader_pin_memory=True, dataloader_persistent_workers=False,
                    dataloader_prefetch_factor=None, dataloader_multiprocessing_context=None,
                    dataloader_in_order=True),
    DDP: dict(accelerator_config=None, parallelism_config=None, fsdp=None, fsdp_config=None,
              deepspeed=None, ddp_find_unused_parameters=None, ddp_bucket_cap_mb=None,
              ddp_broadcast_buffers=None, ddp_static_graph=None),
    NO_COMPILE: dict(torch_compile=False, torch_compile_backend=None, torch_compile_mode=None),
    "Liger kernels are not used": dict(use_liger_kernel=False, liger_kernel_config=None),
    "FSDP2's activation checkpointing: use gradient_checkpointing": dict(
        activation_checkpointing=None, activation_checkpointing_kwargs=None),
    "log levels of transformers are left as they are": dict(log_level="passive",
                                                            log_level_replica="warning"),
    "optimizers that target modules (GaLore, APOLLO) are not implemented": dict(
        optim_target_modules=None),
    "the GRPO loss has no labels to smooth": dict(label_smoothing_factor=0.0),
    "float16 mixed precision is not implemented: load the policy with dtype='float16', or use "
    "bf16": dict(fp16=False),
    "TF32 products stay off: the trainer keeps float32 products exact, which its bit-for-bit "
    "resume rests on": dict(tf32=None),
    "gradient checkpointing runs with transformers' defaults": dict(
        gradient_checkpointing_kwargs=None),
    "the trainer's forward never keeps a KV cache": dict(use_cache=False),
    "NEFTune embedding noise is not implemented": dict(neftune_noise_alpha=None),
    "the trainer does not empty the CUDA cache on a schedule": dict(torch_empty_cache_steps=None),
    "set per_device_train_batch_size and token_budget": dict(auto_find_batch_size=False),
    "metrics are logged every logging_steps optimizer steps": dict(logging_strategy="steps"),
    "rank 0 alone logs (one node)": dict(log_on_each_node=True),
    # None here, not TRL's True (filter): nothing here matches what either value asks
    "a NaN or infinite loss stops the run (its step leaves the parameters non-finite) instead "
    "of being logged or filtered": dict(logging_nan_inf_filter=None),
    "num_tokens is logged instead": dict(include_num_input_tokens_seen="no"),
    "a checkpoint holds the optimizer, the schedule and the rollout state, which a resume "
    "needs": dict(save_only_model=False),
    "rank 0 writes the checkpoints": dict(save_on_each_node=False),
    "no checkpoint is written on a signal": dict(enable_jit_checkpoint=False),
    "a checkpoint does not keep callbacks' states": dict(
        restore_callback_states_from_checkpoint=False),
    "the trainer always runs deterministic algorithms": dict(full_determinism=False),
    "the policy trains where the model you pass lies: move it with .to('cpu')": dict(
        use_cpu=False),
    "every column of a row reaches the reward functions, as in GRPO": dict(
        remove_unused_columns=True),
    "there are no labels: rewards score the completions": dict(label_names=None),
    "no batches are grouped by length": dict(length_column_name="length"),
    "transformers' debug options are not implemented": dict(debug=""),
    "memory shows in the perf/* metrics instead": dict(skip_memory_metrics=True),
    "a Mixture-of-Experts load-balancing loss is not added": dict(router_aux_loss_coef=None),
    "rows are built from the tokens as sampled, turn by turn: a conversation is never "
    "re-tokenized, so it never forks": dict(fork_threshold_tokens=1024),
    "a weight sync is a request to the server, bounded by vllm_request_timeout "
    "(request_timeout)": dict(weight_sync_timeout=1800),
    "the rollout queue is bounded by the token allowance of max_staleness steps instead": dict(
        queue_maxsize=1024),
    # read by scripts and launchers, never by the trainer (as in transformers)
    ANY: dict(do_train=False, do_eval=False, do_predict=False, resume_from_checkpoint=None,
              local_rank=-1),
}
# other values that change nothing here (an empty mapping, a False for None, ...)
ALSO: dict[str, tuple] = {
    "label_smoothing_factor": (0,),
    "tf32": (False,), "activation_checkpointing": (False,), "eval_delay": (0.0,),
    "activation_checkpointing_kwargs": ({},), "gradient_checkpointing_kwargs": ({},),
    "log_on_each_node": (False,), "include_num_input_tokens_seen": (False,),
    "fsdp": ("",), "full_determinism": (True,),
    "remove_unused_columns": (False,), "debug": ([],), "router_aux_loss_coef": (0, 0.0),
}
# field -> (its default here, the values accepted or ANY, why others are refused)
UNREAD: dict[str, tuple[Any, tuple | str, str]] = {
    name: (default, ANY if why == ANY else (default, *ALSO.get(name, ())), why)
    for why, group in NOT_READ.items() for name, default in group.items()}

# TRL 1.16's name -> ours (the source document's), and TRL's default
RENAMED: dict[str, tuple[str, Any]] = {
    "request_timeout": ("vllm_request_timeout", 600),
    "heartbeat_stale_after_s": ("rollout_worker_timeout", 300.0),
    # -1 (TRL: derived from the batch shape) leaves max_concurrent_rollouts as it is
    "max_inflight_tasks": ("max_concurrent_rollouts", -1),
}


def _default(value):
    return field(default_factory=list) if isinstance(value, list) else field(default=value)


# the base class of `AsyncGRPOConfig`: every name above, at its default
# (keyword-only: `AsyncGRPOConfig`'s own fields keep their places, output_dir first)
TRLFields = make_dataclass("TRLFields", [
    *((name, Any, _default(default)) for name, (default, _, _) in UNREAD.items()),
    *((name, Any, _default(default)) for name, (_, default) in RENAMED.items())], kw_only=True)


def _field_default(config, name: str):
    return next(f.default for f in fields(config) if f.name == name)


def problems(config) -> list[str]:
    """What `config` asks of these fields that this trainer does not do; renamed fields are
    moved to ours on the way."""
    found = []
    for name, (_, accepted, why) in UNREAD.items():
        value = getattr(config, name)
        if accepted != ANY and not any(value == ok and isinstance(value, bool) == isinstance(
                ok, bool) for ok in accepted):
            found.append(f"{name}={value!r} is refused: {why}")
    for name, (ours, default) in RENAMED.items():
        value = getattr(config, name)
        if value == default:
            continue
        if getattr(config, ours) not in (value, _field_default(config, ours)):
            found.append(f"{name} (TRL 1.16's name) and {ours} differ: give one of them")
        else:
            setattr(config, ours, value)
    return found


NAMES = frozenset(UNREAD) | frozenset(RENAMED)
