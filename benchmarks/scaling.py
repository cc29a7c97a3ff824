"""How an async GRPO step's cost grows with completion length and with model width.

Two sweeps of the real engine (`AsyncGRPOTrainer`, the embedded server, the default profile's
GRPO settings: groups of 4, 4 prompts a step, tree packing, the fixed schedule with its lag):
- completion length 16, 32, 64, 128 tokens at the default width (256);
- model width 128, 256, 512, 896 (heads of 64, 2 KV heads, 6 layers, MLP 3x) at 64 tokens.
Each point is a randomly initialised Qwen2 of that shape with the embedded tokenizer (random
weights almost never sample EOS, so every completion runs to the length limit: a length sweep
in fact), trained for `--steps` steps on the 672 rollout prompts with a cheap reward that
varies within a group (the share of even token ids in the completion), so no group is dropped.
Reported per point, over the steps after the first (start-up excluded): seconds per step,
trained tokens/s, forwarded tokens/s of the forward and backward, and the share of the step
the trainer waited for rollouts (the server's part). It writes
`outputs/benchmarks/scaling.json`, a markdown table beside it and a plot
(`scaling.png`: step time and trained tokens/s against each variable), and prints the figures
last as one JSON line. The tokenizer and corpus are the pipeline's (`assets/model`,
`data/generated`), built first by `snakemake base_model prepare` when missing.

    python benchmarks/scaling.py            # --steps 6 by default, about 5 minutes here
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from _build import ensure_built  # benchmarks/: the script's own folder

from reprorl.core import config as configuration
from reprorl.grpo.metrics import metrics_file, read_windows
from reprorl.pipeline import corpus
from reprorl.pipeline.grpo_run import engine_settings

LENGTHS, WIDTHS = (16, 32, 64, 128), (128, 256, 512, 896)
DEFAULT_WIDTH, DEFAULT_LENGTH, LAYERS = 256, 64, 6


def even_share(completion_ids, **kwargs) -> list[float]:
    """The share of even token ids: cheap, and different across a group's completions."""
    return [sum(t % 2 == 0 for t in ids) / max(1, len(ids)) for ids in completion_ids]


def random_model(directory: Path, width: int, tokenizer_dir: str, max_len: int) -> str:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=width,
                         intermediate_size=3 * width, num_hidden_layers=LAYERS,
                         num_attention_heads=width // 64, num_key_value_heads=2,
                         max_position_embeddings=max_len, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(width)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def point(profile: dict, width: int, length: int, steps: int, workdir: Path) -> dict:
    from reprorl.grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    name = f"w{width}-l{length}"
    max_len = profile["limits"]["context_tokens"]
    path = random_model(workdir / name / "model", width, profile["model"]["path"], max_len)
    settings = engine_settings(profile)
    settings.update(max_steps=steps, save_strategy="no", logging_steps=1, disable_tqdm=True,
                    temperature=1.0)
    args = AsyncGRPOConfig(output_dir=str(workdir / name / "run"), embedded_server=True,
                           dtype="float32", embedded_server_max_model_len=max_len,
                           max_completion_length=length, **settings)
    rows = [{"prompt": [{"role": "user", "content": p["prompt"]}]}
            for p in corpus.rollout_prompts()]
    AsyncGRPOTrainer(path, even_share, args, rows, log=lambda message: None).train()
    windows = read_windows(metrics_file(workdir / name / "run"))
    steady = [w for w in windows if w.get("perf/step_s") is not None][1:]  # after start-up
    if not steady:
        raise RuntimeError(f"{name}: no step after the first was logged; raise --steps")
    step_s = sum(w["perf/step_s"] for w in steady)
    return {
        "width": width, "completion_tokens": length, "steps": len(steady),
        "step_s": step_s / len(steady),
        "trained_tokens_per_s": sum(w["batch/trained_tokens_per_step"] for w in steady) / step_s,
        "fwd_bwd_forwarded_tokens_per_s": sum(w["batch/forwarded_tokens_per_step"]
                                              for w in steady)
        / sum(w["perf/fwd_bwd_s"] for w in steady),
        "rollout_wait_share": sum(w["perf/rollout_wait_s"] for w in steady) / step_s,
        "mean_completion_tokens": sum(w["completions/mean_length"] for w in steady)
        / len(steady),
    }


def table(points: list[dict]) -> str:
    lines = [("| width | completion tokens (limit) | mean completion | s/step | trained tok/s | "
              "fwd+bwd forwarded tok/s | rollout wait share |"), "|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['width']} | {p['completion_tokens']} | "
                     f"{p['mean_completion_tokens']:.1f} | {p['step_s']:.3f} | "
                     f"{p['trained_tokens_per_s']:.1f} | "
                     f"{p['fwd_bwd_forwarded_tokens_per_s']:.0f} | "
                     f"{100 * p['rollout_wait_share']:.0f} % |")
    return "\n".join(lines) + "\n"


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, key, label, fixed in (
            (axes[0], "completion_tokens", "completion tokens (limit)", DEFAULT_WIDTH),
            (axes[1], "width", "model width", DEFAULT_LENGTH)):
        other = "width" if key == "completion_tokens" else "completion_tokens"
        chosen = sorted((p for p in points if p[other] == fixed), key=lambda p: p[key])
        xs = [p[key] for p in chosen]
        axis.plot(xs, [p["step_s"] for p in chosen], "o-", color="tab:blue")
        axis.set_xlabel(f"{label} ({other.replace('_', ' ')} {fixed})")
        axis.set_ylabel("seconds per step", color="tab:blue")
        twin = axis.twinx()
        twin.plot(xs, [p["trained_tokens_per_s"] for p in chosen], "s--", color="tab:red")
        twin.set_ylabel("trained tokens/s", color="tab:red")
    figure.suptitle("async GRPO step cost (random Qwen2, embedded server, 2 cores)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    parser.add_argument("--out", default="outputs/benchmarks/scaling.json")
    args = parser.parse_args()
    profile = configuration.load(args.config)
    ensure_built(profile["model"]["path"])
    import torch

    torch.set_num_threads(1)  # the trainer; the embedded server has its own thread
    grid = dict.fromkeys([(DEFAULT_WIDTH, n) for n in args.lengths]
                         + [(w, DEFAULT_LENGTH) for w in args.widths])
    workdir = Path(tempfile.mkdtemp(prefix="grpo-scaling-"))
    try:
        points = []
        for width, length in grid:
            points.append(point(profile, width, length, args.steps, workdir))
            print(json.dumps(points[-1]), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(points, indent=1) + "\n")
    out.with_suffix(".md").write_text(table(points))
    plot(points, out.with_suffix(".png"))
    print(table(points))
    print(json.dumps({f"w{p['width']}_l{p['completion_tokens']}_step_s": round(p["step_s"], 3)
                      for p in points}))


if __name__ == "__main__":
    main()
