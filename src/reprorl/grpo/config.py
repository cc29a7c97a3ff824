"""`AsyncGRPOConfig`: the seed's field names and defaults, each with a one-line help.

Only the fields this engine reads are declared (TRL's class also carries every
`TrainingArguments` field). Left out on purpose: the multi-device fields
(`average_tokens_across_devices`, DDP/FSDP), MoE's `router_aux_loss_coef`, evaluation, hub and
`report_to` (metrics go to JSONL and the console), `lr_scheduler_kwargs` (the two schedules
here take none). Departures: `bf16=None` means "mixed precision on a CUDA trainer", which this
CPU engine never is (the seed turns bf16 on unless fp16); `ignore_data_skip` can only be True,
as in the seed. Additions of ours, grouped at the end: `embedded_server*` (start the CPU
server shipped here), `synchronous` (the benchmark's baseline), `vllm_max_retries` and
`lora_rank` / `lora_alpha` (a fresh adapter's shape).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class AsyncGRPOConfig:
    # ---- training loop (TrainingArguments fields, the seed's defaults)
    output_dir: str | None = field(default=None, metadata={
        "help": "Checkpoints, metrics and the `.vllm_lora/` serving cache go here."})
    per_device_train_batch_size: int = field(default=8, metadata={
        "help": "Samples per micro-batch at most (rows also stay within token_budget)."})
    gradient_accumulation_steps: int = field(default=1, metadata={
        "help": "Micro-batches per optimizer step."})
    num_train_epochs: float = field(default=3.0, metadata={
        "help": "Passes over the prompts, counted in distinct prompts consumed."})
    max_steps: int = field(default=-1, metadata={
        "help": "If > 0, stop after this many optimizer steps instead of by epochs."})
    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW peak learning rate."})
    lr_scheduler_type: str = field(default="constant", metadata={
        "help": "'constant' or 'linear' (linear decay needs max_steps > 0)."})
    warmup_steps: float = field(default=0, metadata={
        "help": "Warm-up steps (a float < 1 is a fraction of max_steps)."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.999, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm."})
    logging_steps: float = field(default=1, metadata={
        "help": "Optimizer steps per metrics window (< 1: a fraction of max_steps)."})
    save_steps: float = field(default=500, metadata={
        "help": "Optimizer steps between checkpoints (< 1: a fraction of max_steps)."})
    save_strategy: str = field(default="steps", metadata={
        "help": "'steps' or 'no' (then only the final adapter is written)."})
    save_total_limit: int | None = field(default=None, metadata={
        "help": "Keep at most this many checkpoints (oldest deleted first)."})
    seed: int = field(default=42, metadata={
        "help": "Seeds the trainer and every sampling request (with the rollout's place)."})
    data_seed: int | None = field(default=None, metadata={
        "help": "Seeds the order of the prompts (None: seed)."})
    train_sampling_strategy: str = field(default="random", metadata={
        "help": "'random' (a seeded shuffle per epoch) or 'sequential' (dataset order)."})
    optim: str = field(default="adamw_torch_fused", metadata={
        "help": "'adamw_torch_fused' or 'adamw_torch' (the same AdamW, fused kernel or not)."})
    gradient_checkpointing: bool = field(default=True, metadata={
        "help": "Recompute the policy's activations in the backward pass to save memory."})
    bf16: bool | None = field(default=None, metadata={
        "help": "Autocast forward/backward to bfloat16 (None: only on a CUDA trainer)."})
    ignore_data_skip: bool = field(default=True, metadata={
        "help": "Always True: a resume continues from rollout_state.json, never replays."})
    dtype: str = field(default="float32", metadata={
        "help": "Dtype the policy is loaded in: 'auto', 'float32', 'bfloat16' or 'float16'."})
    model_init_kwargs: dict | None = field(default=None, metadata={
        "help": "Keyword arguments for from_pretrained when the model is given as a path."})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "Allow custom model code when the model is given as a path."})
    disable_tqdm: bool | None = field(default=None, metadata={
        "help": "Hide the progress bar (None: shown)."})
    # ---- generation
    num_generations: int = field(default=8, metadata={"help": "Rollouts per prompt (a group)."})
    max_completion_length: int = field(default=2048, metadata={
        "help": "Tokens generated per sampling request at most."})
    temperature: float = field(default=1.0, metadata={
        "help": "Sampling temperature; the trainer scores with the same one."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling (only 1.0 here)."})
    top_k: int = field(default=0, metadata={"help": "Top-k sampling (only 0 here)."})
    min_p: float | None = field(default=None, metadata={"help": "Min-p sampling (only None)."})
    chat_template_kwargs: dict | str | None = field(default=None, metadata={
        "help": "Extra keyword arguments for apply_chat_template (a dict or its JSON)."})
    max_tool_calling_iterations: int | None = field(default=None, metadata={
        "help": "Tool-calling turns at most (tools arrive in a later release)."})
    # ---- generation server
    vllm_server_base_url: str = field(default="http://localhost:8000", metadata={
        "help": "Base URL of the generation server (vLLM or the embedded one)."})
    vllm_server_timeout: float = field(default=1800.0, metadata={
        "help": "Seconds to wait for the server, per request and per weight sync."})
    # ---- loss
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range of the surrogate."})
    epsilon_high: float | None = field(default=None, metadata={
        "help": "Upper clip range (None: same as epsilon; DAPO suggests 0.28)."})
    score_centering: bool = field(default=True, metadata={
        "help": "Score-centering loss; False uses the clipped surrogate."})
    vllm_importance_sampling_clip_min: float = field(default=0.5, metadata={
        "help": "Tokens whose policy/sampler ratio is below this are left out of the loss."})
    vllm_importance_sampling_clip_max: float = field(default=5.0, metadata={
        "help": "Tokens whose policy/sampler ratio is above this are left out of the loss."})
    num_sampler_logprobs: int = field(default=8, metadata={
        "help": "Top sampler log-probs requested per token, for score centering."})
    token_budget: int | None = field(default=None, metadata={
        "help": "Forwarded tokens per micro-batch row at most (None: server max_model_len)."})
    # ---- asynchronous pipeline
    max_concurrent_rollouts: int = field(default=512, metadata={
        "help": "Rollouts in flight at most."})
    max_staleness: int = field(default=4, metadata={
        "help": "Weight versions a sample may lag at dequeue before it is dropped."})
    weight_sync_steps: int = field(default=1, metadata={
        "help": "Optimizer steps between weight syncs to the server."})
    rollout_worker_timeout: float = field(default=300.0, metadata={
        "help": "Seconds without a worker heartbeat before the trainer stops it."})
    log_completions: bool = field(default=False, metadata={
        "help": "Print sampled completions at each logging step."})
    num_completions_to_print: int | None = field(default=None, metadata={
        "help": "How many completions log_completions prints (None: all of a group)."})
    # ---- additions of this project
    embedded_server: bool = field(default=False, metadata={
        "help": "Start `reprorl serve` on the policy's base model and stop it at the end."})
    embedded_server_threads: int = field(default=1, metadata={
        "help": "Torch threads of the embedded server."})
    embedded_server_max_num_seqs: int = field(default=64, metadata={
        "help": "Sequences the embedded server decodes together at most."})
    embedded_server_max_model_len: int | None = field(default=None, metadata={
        "help": "max_model_len of the embedded server (None: the model's positions)."})
    synchronous: bool = field(default=False, metadata={
        "help": "Baseline: generate one step's samples, then train, one version at a time."})
    vllm_max_retries: int = field(default=3, metadata={
        "help": "Retries of a failed sampling request before the worker gives up."})
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank of a fresh adapter."})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA alpha of a fresh adapter."})

    def __post_init__(self):
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if isinstance(self.chat_template_kwargs, str):
            self.chat_template_kwargs = json.loads(self.chat_template_kwargs)
        problems = []
        for name in ("logging_steps", "save_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value > 0):
                problems.append(f"{name} must be a number > 0")
            elif value > 1 and value != int(value):
                problems.append(f"{name} must be a whole number of steps (or, below 1, a "
                                "fraction of max_steps)")
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {DTYPES}")
        if self.train_sampling_strategy not in ("random", "sequential"):
            problems.append("train_sampling_strategy must be 'random' or 'sequential'")
        if self.optim not in ("adamw_torch_fused", "adamw_torch"):
            problems.append("optim must be 'adamw_torch_fused' or 'adamw_torch'")
        if not self.ignore_data_skip:
            problems.append("ignore_data_skip=False would replay trained batches: a resume "
                            "continues from rollout_state.json instead; keep it True")
        if self.top_p != 1.0 or self.top_k not in (0, -1) or self.min_p not in (None, 0.0):
            problems.append("top_p/top_k/min_p truncation needs the sampling-mask path, not "
                            "built yet: keep top_p=1.0, top_k=0, min_p=None")
        if self.temperature <= 0:
            problems.append("temperature must be > 0 (the trainer divides logits by it)")
        if self.num_generations < 2:
            problems.append("num_generations must be >= 2 (advantages are relative to a group)")
        if not 0 < self.vllm_importance_sampling_clip_min <= 1 <= (
                self.vllm_importance_sampling_clip_max):
            problems.append("need 0 < vllm_importance_sampling_clip_min <= 1 <= "
                            "vllm_importance_sampling_clip_max")
        if self.lr_scheduler_type not in ("constant", "linear"):
            problems.append("lr_scheduler_type must be 'constant' or 'linear'")
        if self.lr_scheduler_type == "linear" and self.max_steps <= 0:
            problems.append("a linear schedule needs max_steps > 0 (the step count of an "
                            "epoch is not known in advance)")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps",
                     "weight_sync_steps", "max_concurrent_rollouts", "max_completion_length"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.synchronous and self.weight_sync_steps != 1:
            problems.append("synchronous=True needs weight_sync_steps=1 (one version per step)")
        if self.max_staleness < 0:
            problems.append("max_staleness must be >= 0")
        if self.score_centering and self.num_sampler_logprobs < 1:
            problems.append("score_centering needs num_sampler_logprobs >= 1")
        if problems:
            raise ValueError("AsyncGRPOConfig: " + "; ".join(problems))

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

    @property
    def data_order_seed(self) -> int:
        return self.seed if self.data_seed is None else self.data_seed

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def help(cls) -> dict[str, str]:
        return {f.name: f.metadata["help"] for f in fields(cls)}
