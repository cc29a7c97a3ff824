"""One PPO iteration and one async GRPO step of a random model at Qwen2.5-0.5B's dimensions.

The seed's real setting without its weights (no hub here): a `Qwen2ForCausalLM` of the 0.5B
architecture (24 layers, width 896, 14 heads, 2 KV heads, vocabulary 151,936, tied embeddings)
with random BF16 weights, saved as a Hugging Face directory beside the embedded tokenizer of
the working directory's pipeline (its ids fit the vocabulary). On it, through the pipeline's
own code and on `--device`:
- PPO: the four roles (`roles.build`: BF16 base, FP32 adapters and heads, the contract
  checked), one iteration of `ppo.iterate` (4 prompts sampled, scored, 2 actor and 2 critic
  updates);
- GRPO: `AsyncGRPOTrainer` with the embedded server on the same device, one optimizer step
  on 4 groups of 4 (a reward that varies between random completions, so no group drops).
Printed: each part's seconds and the peak GPU memory (allocated and reserved), the figures
last as one JSON line. It needs the corpus and the embedded tokenizer of a working directory
(a checkout that ran the pipeline; `benchmarks/gpu_check.sh` runs the CI profile first):

    python benchmarks/gpu_dims.py --device cuda   # --layers 2 for a quick CPU run
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from reprorl.core import config as configuration
from reprorl.core import devices, layout
from reprorl.model import roles
from reprorl.model.encoding import load_tokenizer
from reprorl.pipeline import corpus, ppo

QWEN = configuration.load("configs/qwen2.5-0.5b.yaml")["model"]


def random_model(directory: Path, tokenizer_dir: str, layers: int) -> None:
    """The 0.5B architecture with random BF16 weights (transformers' own init, seed 0)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    expect = QWEN["expect"]
    tokenizer = load_tokenizer(tokenizer_dir)
    shape = {k: expect[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                    "num_key_value_heads", "vocab_size", "tie_word_embeddings")}
    config = Qwen2Config(**shape, num_hidden_layers=layers, max_position_embeddings=32768,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def ppo_iteration(config: dict, device: torch.device) -> dict:
    """The four roles and one `ppo.iterate`, as the pipeline's PPO stage runs them."""
    reset_peak(device)
    started = time.perf_counter()
    built = {kind: roles.build(kind, config["model"]) for kind in roles.ROLES}
    built["reward"].requires_grad_(False)
    contract = roles.isolation_report(built)
    settings, limits = config["ppo"], config["limits"]
    optimizers = {name: torch.optim.AdamW(
        [p for p in built[name].parameters() if p.requires_grad],
        lr=settings[f"{name}_learning_rate"], weight_decay=settings["weight_decay"])
        for name in ("actor", "critic")}
    tokenizer = load_tokenizer(config["model"]["path"])
    pages = corpus.rollout_prompts()[: ppo.PROMPTS_PER_ITERATION]
    generation = torch.Generator().manual_seed(settings["generation_seed"])
    timer = ppo.PhaseTimer()
    built_s = time.perf_counter() - started
    _, entry = ppo.iterate(built, optimizers, tokenizer, pages, 1, generation,
                           lambda step: ppo.learning_rates(settings, step), 0, settings,
                           limits, timer)
    devices.synchronize()
    return {"build_s": round(built_s, 2),
            "iteration_s": round(time.perf_counter() - started - built_s, 2),
            "phase_seconds": {k: round(v, 2) for k, v in timer.seconds.items()},
            "adapter_parameters": built["actor"].adapter_parameters,
            "head_parameters": sum(p.numel() for p in built["reward"].head.parameters()),
            "trainable": {k: v["trainable"] for k, v in contract.items()},
            "mean_reward_model_score": entry["mean_reward_model_score"],
            **devices.memory()}


def varied_reward(completion_ids, **kwargs) -> list[float]:
    """Random weights: what varies between completions is which tokens they drew."""
    return [float(ids[0] % 7) for ids in completion_ids]


def grpo_step(config: dict, device: torch.device, workdir: Path) -> dict:
    from reprorl.grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from reprorl.pipeline.grpo_run import dataset

    reset_peak(device)
    actor = roles.build("actor", config["model"])
    limits = config["limits"]
    args = AsyncGRPOConfig(
        output_dir=str(workdir / "grpo"), embedded_server=True,
        embedded_server_device=str(device), dtype="bfloat16",
        embedded_server_max_model_len=limits["context_tokens"],
        max_completion_length=limits["response_tokens"], max_steps=1, num_generations=4,
        groups_per_step=4, schedule_lag=1, learning_rate=1e-6, save_strategy="no",
        logging_steps=1, disable_tqdm=True, gradient_checkpointing=True)
    trainer = AsyncGRPOTrainer(actor.backbone, varied_reward, args, dataset("learned"),
                               load_tokenizer(config["model"]["path"]), log=print)
    started = time.perf_counter()
    result = trainer.train()
    devices.synchronize()
    return {"steps": result.global_step, "train_s": round(time.perf_counter() - started, 2),
            **devices.memory()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--layers", type=int, default=QWEN["expect"]["num_hidden_layers"],
                        help="fewer than 24 for a quick run (the width stays 0.5B's)")
    parser.add_argument("--config", default="configs/ci.yaml",
                        help="the profile whose corpus and tokenizer are in the working dir")
    args = parser.parse_args()
    device = devices.prepare(args.device)
    base = configuration.load(args.config)
    if not layout.CORPUS.is_dir():
        raise SystemExit(f"no corpus under {layout.CORPUS}: run the pipeline here first "
                         "(benchmarks/gpu_check.sh does)")
    with tempfile.TemporaryDirectory(prefix="gpu-dims-") as scratch:
        workdir = Path(scratch)
        random_model(workdir / "model", base["model"]["path"], args.layers)
        model = {**base["model"], "path": str(workdir / "model"), "dtype": "bfloat16",
                 "attn_implementation": QWEN["attn_implementation"], "device": str(device)}
        config = {**base, "model": model}
        figures = {"device": str(device), "layers": args.layers,
                   "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                   "ppo": ppo_iteration(config, device)}
        print(f"PPO iteration: {figures['ppo']}", flush=True)
        figures["grpo"] = grpo_step(config, device, workdir)
        print(f"GRPO step: {figures['grpo']}", flush=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
