"""The seed's counter environment, trained with async GRPO through the public API.

Each row asks to increment a counter to a target (1 to 6); the environment's `increment` tool
adds to its counter and `get_reward()` pays 1.0 when the counter ends on the target. The
embedded base never writes a tool call by chance, so the policy starts from a short
supervised warm start (`warm_start`, the project's SFT loss): demonstrations of one call with a
step drawn at random, the tool's answer, then "Done.". A step unrelated to the target leaves
GRPO something to learn: pick the step the prompt names.

    python examples/counter_env.py [--model DIR] [--output DIR] [--max-steps N]

Without `--model` it builds the CI-size embedded base first. It prints the run's metrics as
one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

TARGETS = range(1, 7)


class IncrementEnv:
    """A counter to bring to the row's target with one tool."""

    def reset(self, target: int, **row) -> None:
        self.counter, self.target = 0, int(target)

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: the amount
        """
        self.counter += int(step)
        return self.counter


def rows(repeats: int = 4) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"Increment the counter to {t}."}],
             "target": t} for _ in range(repeats) for t in TARGETS]


def demonstrations(seed: int = 0) -> list[list[dict]]:
    """One call each, its step independent of the target: a format, not a skill."""
    rng = random.Random(seed)
    conversations = []
    for row in rows(2):
        step = rng.choice(TARGETS)
        call = {"type": "function", "function": {"name": "increment",
                                                 "arguments": {"step": step}}}
        conversations.append([*row["prompt"],
                              {"role": "assistant", "content": "", "tool_calls": [call]},
                              {"role": "tool", "name": "increment", "content": str(step)},
                              {"role": "assistant", "content": "Done."}])
    return conversations


def encode(tokenizer, conversation: list[dict], tools: list) -> tuple[list[int], list[int]]:
    """Token ids of a conversation and a mask of the assistant's own tokens (its replies up to
    and including the end-of-turn token), rendered as the rollout loop renders them."""
    ids, mask = [], []
    for i, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(conversation[:i], tools=tools, tokenize=False,
                                               add_generation_prompt=True)
        after = tokenizer.apply_chat_template(conversation[:i + 1], tools=tools,
                                              tokenize=False)
        reply = after[len(before):].removesuffix("\n")  # the newline after <|im_end|>
        context = tokenizer(before, add_special_tokens=False)["input_ids"][len(ids):]
        answer = tokenizer(reply, add_special_tokens=False)["input_ids"]
        ids += context + answer
        mask += [0] * len(context) + [1] * len(answer)
    return ids, mask


def warm_start(base: Path, output: Path, steps: int = 200, learning_rate: float = 5e-3,
               seed: int = 0) -> Path:
    """Fine-tune every weight of `base` on the demonstrations; save to `output` (atomic)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reprorl.model.losses import sft_loss

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(base, local_files_only=True,
                                                 dtype=torch.float32)
    tools = [IncrementEnv().increment]
    encoded = [encode(tokenizer, c, tools) for c in demonstrations(seed)]
    width = max(len(ids) for ids, _ in encoded)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in encoded])
    attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in encoded])
    mask = torch.tensor([m + [0] * (width - len(m)) for _, m in encoded], dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    model.train()
    for _ in range(steps):
        logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1]
        logprobs = torch.log_softmax(logits.float(), -1).gather(
            -1, input_ids[:, 1:, None])[..., 0]
        loss = sft_loss(logprobs, mask[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    output.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=output.name + ".", dir=output.parent))
    model.save_pretrained(scratch)
    tokenizer.save_pretrained(scratch)
    shutil.rmtree(output, ignore_errors=True)
    os.replace(scratch, output)
    return output


def embedded_base(directory: Path) -> Path:
    """The CI-size embedded base (configs/ci.yaml), built once into `directory`."""
    from reprorl.core import config as configuration
    from reprorl.pipeline import base_model

    if not (directory / "config.json").is_file():
        root = Path(__file__).resolve().parents[1]
        config = configuration.load(root / "configs" / "ci.yaml")
        config["model"]["path"] = str(directory)
        shutil.rmtree(directory, ignore_errors=True)
        base_model.build_embedded(config, log=lambda message: None)
    return directory


def train(model: Path, output: Path, max_steps: int = 6, log=print, loop_cls=None,
          train_dataset=tuple(rows()), environment_factory=IncrementEnv, reward_funcs=None,
          processing_class=None, **overrides):
    """Async GRPO on the counter task; returns the trainer (its metrics.jsonl in `output`).
    The keywords after `log` let a test swap a part: the rollout loop, the rows (None: the
    environment makes its own tasks), ..."""
    from reprorl.grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    settings = dict(
        output_dir=str(output), max_steps=max_steps, num_generations=6,
        per_device_train_batch_size=2, learning_rate=2e-3, max_completion_length=64,
        max_tool_calling_iterations=2, temperature=1.0, logging_steps=1, save_steps=max_steps,
        embedded_server=True, embedded_server_max_model_len=512, disable_tqdm=True,
        schedule_lag=1, seed=0)
    trainer = AsyncGRPOTrainer(model=str(model), args=AsyncGRPOConfig(**{**settings,
                                                                        **overrides}),
                               train_dataset=train_dataset, reward_funcs=reward_funcs,
                               environment_factory=environment_factory,
                               processing_class=processing_class, log=log)
    if loop_cls is not None:
        trainer.loop_cls = loop_cls
    trainer.train()
    return trainer


def main() -> None:
    from reprorl.grpo.metrics import metrics_file, read_windows

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a base model directory (default: build "
                        "the CI-size embedded base under --output)")
    parser.add_argument("--output", type=Path, default=Path("counter-env-output"))
    parser.add_argument("--max-steps", type=int, default=6)
    options = parser.parse_args()
    started = time.monotonic()
    base = options.model or embedded_base(options.output / "base")
    policy = warm_start(base, options.output / "tool-caller")
    warm_s = time.monotonic() - started
    train(policy, options.output / "grpo", options.max_steps,
          log=lambda message: print(message, file=sys.stderr))
    history = metrics_file(options.output / "grpo")
    windows = read_windows(history)
    if not windows:
        raise SystemExit(f"{history} holds no metrics window")
    keys = ("reward", "rewards/IncrementEnv/mean", "tools/call_frequency",
            "tools/failure_frequency", "tools/increment/call_count", "rollout/turns_mean",
            "rollout/fork_frac", "completions/mean_length")
    print(json.dumps({"seconds": round(time.monotonic() - started, 1),
                      "warm_start_s": round(warm_s, 1),
                      "windows": [{k: w.get(k) for k in ("step", *keys)} for w in windows
                                  if "loss" in w]}))


if __name__ == "__main__":
    main()
