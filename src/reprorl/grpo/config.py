"""`AsyncGRPOConfig`: the seed's field names and defaults, each with a one-line help.

The fields this engine reads are declared here; under `torchrun` the ranks train with DDP
(`distributed.py`), which reads `average_tokens_across_devices`, `ddp_backend` and
`ddp_timeout`. The fields of ours (`embedded_server*`, `schedule_lag`, `synchronous`,
`groups_per_step`, the watchdogs, `weight_sync_check*`, ...) are grouped at the end. Every
other field of TRL 1.16's class is accepted by name from `trl_fields.TRLFields`, refused at a
value this engine does not honour. Every number is checked finite and in range when the config
is made. docs/grpo.md lists the fields not read, the additions, and the departures.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields

from . import optimizers, schedule, trl_fields
from .trl_fields import TRLFields

DTYPES = ("auto", "float32", "bfloat16", "float16")


def option(default, text: str):
    """A field with its one-line help (`AsyncGRPOConfig.help()`)."""
    return field(default=default, metadata={"help": text})


@dataclass
class AsyncGRPOConfig(TRLFields):
    """TRL's config: the fields this trainer reads below; those it does not read, from TRL's
    class, come from `TRLFields` (`trl_fields.py`), each refused at a value it does not honour."""

    # ---- training loop (TrainingArguments fields, the seed's defaults)
    output_dir: str | None = option(
        None, "Checkpoints, metrics and the `.vllm_lora/` serving cache go here.")
    per_device_train_batch_size: int = option(
        8, "Packed rows per micro-batch; token_budget decides how many samples a row holds.")
    gradient_accumulation_steps: int = option(1, "Micro-batches per optimizer step.")
    average_tokens_across_devices: bool = option(
        True, "Across ranks, divide a micro-batch's loss by the trained tokens of all ranks.")
    ddp_backend: str | None = option(
        None, "torch.distributed backend under torchrun (None: nccl for a model on a GPU, "
        "else gloo).")
    ddp_timeout: int = option(
        1800, "Seconds a rank may wait for the others in a collective (rank 0's rollouts).")
    num_train_epochs: float = option(
        3.0, "Passes over the prompts, counted in distinct prompts consumed.")
    max_steps: int = option(
        -1, "If > 0, stop after this many optimizer steps instead of by epochs.")
    learning_rate: float = option(1e-6, "AdamW peak learning rate.")
    lr_scheduler_type: str = option(
        "constant", "Any of transformers' schedulers but those following a metric; those that "
        "decay over the run (linear, cosine, ...) need max_steps > 0.")
    lr_scheduler_kwargs: dict | str | None = option(
        None, "The scheduler's own arguments (num_cycles, power, min_lr, ...), or their JSON.")
    warmup_steps: float = option(0, "Warm-up steps (a float < 1 is a fraction of max_steps).")
    weight_decay: float = option(0.0, "AdamW weight decay.")
    adam_beta1: float = option(0.9, "AdamW beta1.")
    adam_beta2: float = option(0.999, "AdamW beta2.")
    adam_epsilon: float = option(1e-8, "AdamW epsilon.")
    max_grad_norm: float = option(1.0, "Gradient clipping norm.")
    logging_steps: float = option(
        1, "Optimizer steps per metrics window (< 1: a fraction of max_steps).")
    logging_first_step: bool = option(False, "Also log a window after the first step.")
    report_to: str | list[str] | None = option(
        "none", "Logging integrations, transformers' callbacks: 'none', 'all' (every one "
        "installed), or names: 'trackio' (local), 'tensorboard', 'wandb' (WANDB_MODE=offline).")
    run_name: str | None = option(None, "The run's name in the logging integrations.")
    project: str = option("huggingface", "The trackio project the run is logged in.")
    logging_dir: str | None = option(
        None, "TensorBoard's event folder (transformers 4's field; None: "
        "$TENSORBOARD_LOGGING_DIR, else output_dir/runs/<time>_<host>).")
    save_steps: float = option(
        500, "Optimizer steps between checkpoints (< 1: a fraction of max_steps).")
    save_strategy: str = option(
        "steps", "'steps' or 'no' (then only the final adapter is written).")
    save_total_limit: int | None = option(
        None, "Keep at most this many checkpoints (oldest deleted first).")
    seed: int = option(
        42, "Seeds the trainer and every sampling request (with the rollout's place).")
    data_seed: int | None = option(None, "Seeds the order of the prompts (None: seed).")
    train_sampling_strategy: str = option(
        "random", "'random' (a seeded shuffle per epoch) or 'sequential' (dataset order).")
    optim: str = option("adamw_torch_fused", "'adamw_torch_fused' or 'adamw_torch' (the same "
                        "AdamW, fused kernel or not), or torch's 'sgd', 'adagrad', 'rmsprop'.")
    optim_args: str | None = option(
        None, "sgd/adagrad/rmsprop's arguments as 'key=value,...' (momentum=0.9, ...).")
    gradient_checkpointing: bool = option(
        True, "Recompute the policy's activations in the backward pass to save memory.")
    bf16: bool | None = option(
        None, "Autocast forward/backward to bfloat16 (None: off; dtype sets the base's).")
    ignore_data_skip: bool = option(
        True, "Always True: a resume continues from rollout_state.json, never replays.")
    dtype: str = option(
        "float32", "Dtype the policy is loaded in: 'auto', 'float32', 'bfloat16' or 'float16'.")
    model_init_kwargs: dict | None = field(default=None, metadata={  # a dict type: not option
        "help": "Keyword arguments for from_pretrained when the model is given as a path."})
    trust_remote_code: bool = option(
        False, "Allow custom model code when the model is given as a path.")
    disable_tqdm: bool | None = option(None, "Hide the progress bar (None: shown).")
    # ---- generation
    num_generations: int = option(8, "Rollouts per prompt (a group).")
    max_completion_length: int = option(2048, "Tokens generated per sampling request at most.")
    temperature: float = option(1.0, "Sampling temperature; the trainer scores with the same one.")
    top_p: float = option(
        1.0, "Nucleus sampling, in (0, 1]; below 1 needs top_k (it bounds the candidate set).")
    top_k: int = option(
        0, "Keep the k likeliest tokens (0: off); the trainer renormalises over each set.")
    min_p: float | None = option(
        None, "Drop tokens below min_p x the top probability (None/0: off); needs top_k.")
    repetition_penalty: float = option(
        1.0, "vLLM's penalty on tokens already in the prompt or output (> 1: fewer repeats).")
    chat_template_kwargs: dict | str | None = field(default=None, metadata={
        "help": "Extra keyword arguments for apply_chat_template (a dict or its JSON)."})
    max_tool_calling_iterations: int | None = option(
        None, "Tool-calling turns per rollout at most (None: until a turn calls no tool).")
    # ---- generation server
    vllm_server_base_url: str = option(
        "http://localhost:8000", "Base URL of the generation server (vLLM or the embedded one).")
    vllm_server_timeout: float = option(
        1800.0, "Seconds to wait for the server to come up (its /health) at the start.")
    # ---- loss
    epsilon: float = option(0.2, "Lower clip range of the surrogate.")
    epsilon_high: float | None = option(
        None, "Upper clip range (None: same as epsilon; DAPO suggests 0.28).")
    score_centering: bool = option(True, "Score-centering loss; False uses the clipped surrogate.")
    vllm_importance_sampling_clip_min: float = option(
        0.5, "Tokens whose policy/sampler ratio is below this are left out of the loss.")
    vllm_importance_sampling_clip_max: float = option(
        5.0, "Tokens whose policy/sampler ratio is above this are left out of the loss.")
    num_sampler_logprobs: int = option(
        8, "Top sampler log-probs requested per token, for score centering.")
    token_budget: int | None = option(
        None, "Tokens of one packed row at most, a prefix its samples share counted once "
        "(None: the server's max_model_len, so that every sample fits).")
    # ---- asynchronous pipeline
    max_concurrent_rollouts: int = option(512, "Rollouts in flight at most.")
    max_staleness: int = option(
        4, "Weight versions a sample may lag at dequeue before it is dropped.")
    weight_sync_steps: int = option(1, "Optimizer steps between weight syncs to the server.")
    rollout_worker_timeout: float = option(
        300.0, "Seconds without a worker heartbeat before the trainer stops it.")
    log_completions: bool = option(False, "Print sampled completions at each logging step.")
    num_completions_to_print: int | None = option(
        None, "How many completions log_completions prints (None: all of a group).")
    # ---- additions of this project
    embedded_server: bool = option(
        False, "Start `reprorl serve` on the policy's base model and stop it at the end.")
    embedded_server_threads: int = option(1, "Torch threads of the embedded server.")
    embedded_server_device: str = option(
        "cpu", "Device of the embedded server's model: auto, cpu, cuda or cuda:N.")
    embedded_server_max_num_seqs: int = option(
        64, "Sequences the embedded server decodes together at most.")
    embedded_server_max_model_len: int | None = option(
        None, "max_model_len of the embedded server (None: the model's positions).")
    schedule_lag: int | None = option(
        None, "None: free-running (timing decides the version; not reproducible). L: step s "
        "trains the groups of its positions, sampled by version max(0, s - L).")
    synchronous: bool = option(
        False, "Baseline: schedule_lag=0, generate one step's groups, then train on them.")
    groups_per_step: int | None = option(
        None, "A fixed schedule's step: this many consecutive prompt positions (None: "
        "per_device_train_batch_size x gradient_accumulation_steps, a group per row).")
    vllm_max_retries: int = option(3, "Retries of a failed sampling request, then it fails.")
    vllm_server_api_key: str | None = option(
        None, "Bearer key of the server's --api-key (None: $VLLM_API_KEY; embedded: a fresh one).")
    vllm_request_timeout: float = option(600.0, "Seconds one request to the server may take.")
    reward_timeout: float = option(600.0, "Seconds a reward function may take on one group.")
    tool_timeout: float = option(
        60.0, "Seconds a tool call may run before it fails; an environment's reset or "
        "get_reward that runs longer fails the run.")
    stall_timeout: float = option(1800.0, "Seconds without a trained sample, then the run stops.")
    weight_sync_check: bool | None = option(
        None, "Prove each sync with a canary request (None: on for an external server only).")
    weight_sync_check_tolerance: float = option(
        0.05, "Largest mean |server - trainer| log-prob over the canary's tokens, in nats.")
    use_peft: bool = option(
        True, "Train a LoRA adapter; False: every weight, synced to the server as full weights.")
    lora_rank: int = option(8, "LoRA rank of a fresh adapter.")
    lora_alpha: float = option(16.0, "LoRA alpha of a fresh adapter.")

    def __post_init__(self):
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.synchronous and self.schedule_lag is None:
            self.schedule_lag = 0
        for name in ("chat_template_kwargs", "lr_scheduler_kwargs"):  # JSON, as in TRL
            if isinstance(getattr(self, name), str):
                setattr(self, name, json.loads(getattr(self, name)))
        from .callbacks import report_names

        self.report_to = report_names(self.report_to)  # a list, as TrainingArguments makes it
        # TRL's names first: a renamed field moves its value to ours before the checks
        problems = [*trl_fields.problems(self), *self._step_problems(),
                    *self._choice_problems(), *self._range_problems()]
        if problems:
            raise ValueError("AsyncGRPOConfig: " + "; ".join(problems))
        if self.groups_per_step is None:
            self.groups_per_step = (self.per_device_train_batch_size
                                    * self.gradient_accumulation_steps)

    def _step_problems(self):
        for name in ("logging_steps", "save_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value > 0):
                yield f"{name} must be a number > 0"
            elif value > 1 and value != int(value):
                yield (f"{name} must be a whole number of steps (or, below 1, a fraction of "
                       "max_steps)")

    def _choice_problems(self):
        from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

        unknown = [n for n in self.report_to if n not in INTEGRATION_TO_CALLBACK]
        if unknown:
            yield (f"report_to {unknown} is not an integration: use 'none', 'all' or any of "
                   f"{sorted(INTEGRATION_TO_CALLBACK)}")
        if self.dtype not in DTYPES:
            yield f"dtype must be one of {DTYPES}"
        if self.ddp_backend not in (None, "gloo", "nccl"):
            yield "ddp_backend must be None, 'gloo' (CPU tensors) or 'nccl' (GPU tensors)"
        if self.train_sampling_strategy not in ("random", "sequential"):
            yield "train_sampling_strategy must be 'random' or 'sequential'"
        yield from optimizers.problems(self)
        if not self.ignore_data_skip:
            yield ("ignore_data_skip=False would replay trained batches: a resume continues "
                   "from rollout_state.json instead; keep it True")
        if (self.top_p < 1 or (self.min_p or 0) > 0) and self.top_k <= 0:
            yield ("top_p < 1 and min_p > 0 need top_k > 0: the server bounds each token's "
                   "candidate set, which the trainer renormalises over, by top_k")
        if self.synchronous and self.schedule_lag != 0:  # __post_init__ set None to 0
            yield "synchronous=True is schedule_lag=0: leave schedule_lag unset"
        if self.schedule_lag is not None and self.weight_sync_steps != 1:
            yield "a fixed schedule (schedule_lag, synchronous) needs weight_sync_steps=1"
        if not self.use_peft and self.schedule_lag not in (None, 0):
            yield ("schedule_lag >= 1 samples from several weight versions at once, and a server "
                   "holds one version of full weights: with use_peft=False use schedule_lag=0 "
                   "(synchronous) or None (free-running), or train a LoRA (use_peft=True)")

    def _number_problems(self):
        """Every numeric field a finite number of its declared kind (None where allowed)."""
        for spec in fields(self):
            value = getattr(self, spec.name)
            kinds = str(spec.type)
            if value is None or not ("int" in kinds or "float" in kinds):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                yield f"{spec.name} must be a number, got {value!r}"
            elif not math.isfinite(value):
                yield f"{spec.name} must be finite, got {value!r}"
            elif "float" not in kinds and value != int(value):
                yield f"{spec.name} must be a whole number, got {value!r}"

    def _range_problems(self):
        numbers = list(self._number_problems())
        if numbers:
            yield from numbers
            return  # the checks below compare numbers
        if self.temperature <= 0:
            yield "temperature must be > 0 (the trainer divides logits by it)"
        if self.num_generations < 2:
            yield "num_generations must be >= 2 (advantages are relative to a group)"
        if not 0 < self.vllm_importance_sampling_clip_min <= 1 <= (
                self.vllm_importance_sampling_clip_max):
            yield ("need 0 < vllm_importance_sampling_clip_min <= 1 <= "
                   "vllm_importance_sampling_clip_max")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps",
                     "weight_sync_steps", "max_concurrent_rollouts", "max_completion_length",
                     "embedded_server_threads", "embedded_server_max_num_seqs", "lora_rank",
                     "ddp_timeout",
                     "token_budget", "embedded_server_max_model_len", "save_total_limit",
                     "groups_per_step"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                yield f"{name} must be >= 1"
        if not 0 < self.top_p <= 1:
            yield "top_p must be in (0, 1]"
        if self.repetition_penalty <= 0:
            yield "repetition_penalty must be > 0 (1: off)"
        if self.top_k < -1 or (self.min_p is not None and not 0 <= self.min_p <= 1):
            yield "top_k must be >= 0 (-1 or 0: off) and min_p in [0, 1]"
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            yield "max_tool_calling_iterations must be >= 0 (or None: no limit)"
        for name in ("max_staleness", "vllm_max_retries", "num_sampler_logprobs",
                     "learning_rate", "weight_decay", "warmup_steps", "epsilon"):
            if getattr(self, name) < 0:
                yield f"{name} must be >= 0"
        for name in ("num_train_epochs", "max_grad_norm", "adam_epsilon", "lora_alpha",
                     "vllm_server_timeout", "vllm_request_timeout", "rollout_worker_timeout",
                     "reward_timeout", "tool_timeout", "stall_timeout",
                     "weight_sync_check_tolerance"):
            if getattr(self, name) <= 0:
                yield f"{name} must be > 0"
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                yield f"{name} must be in [0, 1)"
        if self.epsilon_high < self.epsilon:
            yield "epsilon_high must be >= epsilon"
        if self.schedule_lag is not None and not 0 <= self.schedule_lag <= self.max_staleness:
            yield "schedule_lag must be in [0, max_staleness]: its samples are that stale"
        if self.score_centering and self.num_sampler_logprobs < 1:
            yield "score_centering needs num_sampler_logprobs >= 1"
        yield from schedule.problems(self)

    def steps_of(self, name: str) -> int:
        """`logging_steps` or `save_steps` in optimizer steps, resolved when training starts
        (as TrainingArguments does): a value below 1 is a fraction of `max_steps`."""
        value = getattr(self, name)
        if value >= 1:
            return int(value)
        if self.max_steps <= 0:
            raise ValueError(f"AsyncGRPOConfig: {name}={value} is a fraction of max_steps: "
                             "set max_steps > 0, or give a whole number of steps")
        return max(1, math.ceil(value * self.max_steps))

    def schedule_version(self, position: int) -> int | None:
        """The weight version that samples `position`'s group (None: free-running)."""
        if self.schedule_lag is None:
            return None
        return max(0, position // self.groups_per_step - self.schedule_lag)

    @property
    def truncated_sampling(self) -> bool:
        """Whether top-k/top-p/min-p restrict what the sampler draws from."""
        return self.top_k > 0 or self.top_p < 1 or (self.min_p or 0) > 0

    @property
    def data_order_seed(self) -> int:
        return self.seed if self.data_seed is None else self.data_seed

    def to_dict(self) -> dict:
        """The fields this trainer reads (TRL's others can only hold what changes nothing)."""
        return {k: v for k, v in asdict(self).items() if k not in trl_fields.NAMES}

    def to_json_string(self) -> str:
        """`to_dict` as JSON (what the logging integrations record of a run's arguments)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)

    @classmethod
    def help(cls) -> dict[str, str]:
        return {f.name: f.metadata["help"] for f in fields(cls) if f.name not in trl_fields.NAMES}
