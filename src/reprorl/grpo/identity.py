"""What a GRPO checkpoint must share with the run that resumes it.

`run_identity` fingerprints the settings that shape training (all but those a resume may
change) and the prompts; `refuse_other_run` compares a checkpoint's `rollout_state.json` with
it and names what differs. Fingerprints use a strict JSON encoding: sets sorted, arrays as
lists, dtypes by name; a dataset value without one is refused, a config object stands for its
type (never a repr with a memory address).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from .config import AsyncGRPOConfig
from .schedule import NEEDS_LENGTH

# Settings a resume may change: where and how often things are written, how long to run, how
# to reach the server, and memory-only choices. Any other difference makes a checkpoint refuse
# to resume (max_steps too, when the learning-rate schedule depends on it).
# where the run's logs go (`callbacks.py`): nothing trained depends on them
LOGGING = frozenset({"logging_first_step", "report_to", "run_name", "project", "logging_dir"})
RESUMABLE_CHANGES = LOGGING | frozenset({
    "output_dir", "max_steps", "num_train_epochs", "logging_steps", "save_steps",
    "save_strategy", "save_total_limit", "disable_tqdm", "log_completions",
    "num_completions_to_print", "vllm_server_base_url", "vllm_server_timeout",
    "rollout_worker_timeout", "vllm_max_retries", "max_concurrent_rollouts",
    "embedded_server", "embedded_server_threads", "embedded_server_max_num_seqs",
    "gradient_checkpointing", "vllm_request_timeout", "reward_timeout", "tool_timeout",
    "stall_timeout",
    "ddp_backend", "ddp_timeout",
    "vllm_server_api_key"})  # a secret: never written into a checkpoint


# fields this trainer reads since checkpoints were first written: left out of the identity at
# their default (nothing), so the checkpoints of a run that does not use them keep their bytes
# (a missing field counts at its default: `refuse_other_run`)
LATER_FIELDS = frozenset({"lr_scheduler_kwargs", "optim_args"})


def _json_like(value):
    """`json.dumps` default for fingerprints: sets sorted, arrays as lists, dtypes by name."""
    if isinstance(value, (set, frozenset)):
        return sorted(json.dumps(v, sort_keys=True, default=_json_like) for v in value)
    if isinstance(value, torch.dtype):
        return str(value)
    if hasattr(value, "tolist"):  # numpy and torch values
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} value")


def _settings_like(value):  # config values: an object stands for its type (no addresses)
    try:
        return _json_like(value)
    except TypeError:
        return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _config_fingerprint(settings: dict) -> dict:
    return json.loads(json.dumps(settings, sort_keys=True, default=_settings_like))


def run_identity(args: AsyncGRPOConfig, rows: list[dict], world_size: int = 1,
                 sources: dict | None = None) -> dict:
    """What a resumed run must share with the checkpoint it continues; `world_size`, the
    trainer ranks, when more than one (a step's micro-batches are dealt to them); `sources`,
    the names of the reward functions, tools, environments and rollout loop."""
    settings = {k: v for k, v in args.to_dict().items() if k not in RESUMABLE_CHANGES
                and not (k in LATER_FIELDS and not v)}
    if args.lr_scheduler_type in NEEDS_LENGTH or 0 < args.warmup_steps < 1:
        settings["max_steps"] = args.max_steps  # the schedule is a function of it
    if not isinstance(rows, list):  # a stream (rows.StreamRows): read by the worker only
        kind = type(rows.dataset)
        rows = [f"stream of {kind.__module__}.{kind.__qualname__}"]
    try:
        data = json.dumps(rows, sort_keys=True, default=_json_like).encode()
    except TypeError as error:
        raise ValueError(f"train_dataset cannot be fingerprinted for checkpoints ({error}): "
                         "keep its columns JSON-like (str, numbers, lists, dicts)") from error
    identity = {"config": _config_fingerprint(settings), "dataset_rows": len(rows),
                "dataset_sha256": hashlib.sha256(data).hexdigest()}
    if world_size > 1:  # a one-rank identity has no such key
        identity["world_size"] = world_size
    if sources is not None:
        identity["sources"] = sources
    return identity


def refuse_other_run(checkpoint: Path, state: dict, identity: dict,
                     args: AsyncGRPOConfig) -> None:
    """Raise ValueError, naming the difference, unless `state` was written by this run."""
    if "config" not in state or "dataset_sha256" not in state:
        raise ValueError(f"{checkpoint} holds no run identity (an older release wrote it), "
                         "so nothing shows it continues this run: train in a fresh "
                         "output_dir")
    if state["dataset_rows"] != identity["dataset_rows"] or (
            state["dataset_sha256"] != identity["dataset_sha256"]):
        raise ValueError(f"{checkpoint} was trained on other prompts ({state['dataset_rows']}"
                         f" rows; this dataset has {identity['dataset_rows']} and another "
                         "sha256): resume with the same train_dataset, or train in a fresh "
                         "output_dir")
    if state.get("world_size", 1) != identity.get("world_size", 1):
        raise ValueError(f"{checkpoint} was trained by {state.get('world_size', 1)} rank(s), "
                         f"this run has {identity.get('world_size', 1)}: a step's micro-"
                         "batches are dealt to the ranks, so resume with torchrun "
                         f"--nproc-per-node {state.get('world_size', 1)}, or train in a "
                         "fresh output_dir")
    if "sources" in state and state["sources"] != identity.get("sources"):
        old, new = state["sources"], identity.get("sources") or {}
        details = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}"
                            for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k))
        raise ValueError(f"{checkpoint} was trained with other rollout parts ({details}): "
                         "resume with the same reward functions, tools, environments and "
                         "rollout loop, or train in a fresh output_dir")
    # a field one side lacks (a release added it) counts at its default
    defaults = _config_fingerprint({f.name: f.default for f in dataclasses.fields(args)
                                    if f.default is not dataclasses.MISSING})
    changed = sorted(k for k in identity["config"].keys() | state["config"].keys()
                     if identity["config"].get(k, defaults.get(k))
                     != state["config"].get(k, defaults.get(k)))
    if changed:
        details = ", ".join(f"{k}: {state['config'].get(k)!r} -> "
                            f"{identity['config'].get(k)!r}" for k in changed)
        raise ValueError(f"{checkpoint} was written under other settings ({details}): "
                         "resume with the same ones, or train in a fresh output_dir")
