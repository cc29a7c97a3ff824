"""The engine's prefill with and without reusing the heads prompts share, side by side.

The embedded server, in process: the profile's base model with the server's adapter layers and
three random LoRA adapters (rank 16, three weight versions in flight), on one torch thread (the
server's). The first 48 rollout prompts of the corpus as the GRPO worker renders them (the
chat template's system turn and the user turn's opening: the same first 29 tokens), 4 samples
each (a group), up to 20 new tokens, 64 slots of 512 tokens: the GRPO loop's shapes. Arm
`heads`: today's engine, where a prompt forwards only what follows the whole 32-token blocks it
shares with a recent prompt of the same adapter (`Engine.shared_head`); arm `whole`: the same
engine with that reuse off, every new prompt forwarded whole. Both arms must draw the same
tokens and log-probs, bit for bit (the reuse keeps the whole forward's bits); the rounds
alternate. The model and corpus come from `snakemake base_model prepare` when missing.

    python benchmarks/prefill_heads.py [--rounds 3]

Printed last, one JSON line: each arm's prefill and total seconds (best round: the first
`heads` round also pays the once-per-process probe, `invariance.heads_invariant`), the prefill
speedup, and the reused tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from _build import ensure_built  # benchmarks/: the script's own folder

from reprorl.core import config as configuration
from reprorl.grpo.rollout import prompt_token_ids
from reprorl.model.encoding import load_tokenizer
from reprorl.pipeline.grpo_run import dataset
from reprorl.serve.adapters import Adapter
from reprorl.serve.engine import Engine
from reprorl.serve.logprobs import Params
from reprorl.serve.sequence import Sequence
from reprorl.serve.weights import install_switches

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, GROUP, NEW_TOKENS, SLOTS, MAX_LEN, RANK = 48, 4, 20, 64, 512, 16


def served_model(path: str):
    """The base model with the server's adapter layers (`Switch`) and three adapters."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    switches = install_switches(model)
    generator = torch.Generator().manual_seed(0)
    adapters = [Adapter(f"v{i}", "", {
        name: (0.05 * torch.randn(RANK, s.base.in_features, generator=generator),
               0.05 * torch.randn(s.base.out_features, RANK, generator=generator), 2.0)
        for name, s in switches.items()}) for i in range(3)]
    return model, switches, adapters


def run(model, switches, adapters, prompts, reuse: bool, new_tokens: int = NEW_TOKENS) -> dict:
    """One arm: every group's samples through a fresh engine; the time of its prefills."""
    engine = Engine(model, switches, SLOTS, SLOTS * MAX_LEN, MAX_LEN)
    if not reuse:
        engine.reusable = False  # as if the probe had failed: every new prompt whole
    params = Params(max_tokens=new_tokens, temperature=1.0, logprobs=1, eos_id=-1)
    seqs = [Sequence(list(prompts[i // GROUP]), params, adapters[i // (4 * GROUP) % 3],
                     torch.Generator().manual_seed(i)) for i in range(GROUP * len(prompts))]
    spent = [0.0]
    prefill = engine.prefill

    def timed(seq):
        started = time.perf_counter()
        try:
            return prefill(seq)
        finally:
            spent[0] += time.perf_counter() - started
    engine.prefill = timed
    started = time.perf_counter()
    engine.generate(seqs)
    return {"total_s": time.perf_counter() - started, "prefill_s": spent[0],
            "reused_tokens": engine.work["prefill_shared_tokens"],
            "outputs": [(s.generated, s.logprobs) for s in seqs]}


def arguments(doc: str, rounds: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/default.yaml"))
    parser.add_argument("--rounds", type=int, default=rounds)
    return parser.parse_args()


def served(configfile: str) -> tuple[list[list[int]], tuple]:
    """The first PROMPTS rollout prompts as token ids, and `served_model` on one thread (both
    built first when missing)."""
    path = configuration.load(configfile)["model"]["path"]
    ensure_built(path, configfile)
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(path)
    prompts = [prompt_token_ids(tokenizer, row["prompt"]) for row in dataset("verifier")]
    return prompts[:PROMPTS], served_model(path)


def alternate(rounds: int, arms: dict, by: str) -> tuple[dict, bool]:
    """Each arm (a name and a call that returns `run`'s result) `rounds` times, the arms
    alternating: each arm's best round by `by` (a seconds key), and whether every arm drew
    the same tokens and log-probs."""
    best: dict[str, dict] = {}
    outputs = {}
    with torch.inference_mode():
        for round_ in range(rounds):
            for arm, call in arms.items():
                result = call()
                outputs[arm] = result.pop("outputs")
                print(f"round {round_ + 1} {arm}: {result['total_s']:.3f} s, prefill "
                      f"{result['prefill_s']:.3f} s, {result['reused_tokens']} tokens reused",
                      flush=True)
                if arm not in best or result[by] < best[arm][by]:
                    best[arm] = result
    same = all(output == outputs[next(iter(arms))] for output in outputs.values())
    print(f"same tokens and log-probs in both arms: {same}")
    return best, same


def seconds(best: dict) -> dict:
    """The best rounds' seconds, for the JSON line."""
    return {key: {arm: round(r[key], 3) for arm, r in best.items()}
            for key in ("prefill_s", "total_s")}


def main() -> None:
    args = arguments(__doc__, 3)
    prompts, (model, switches, adapters) = served(args.config)
    best, same = alternate(args.rounds, {
        arm: lambda reuse=reuse: run(model, switches, adapters, prompts, reuse)
        for arm, reuse in (("heads", True), ("whole", False))}, "prefill_s")
    print(json.dumps({**seconds(best),
                      "prefill_speedup": round(best["whole"]["prefill_s"]
                                               / best["heads"]["prefill_s"], 3),
                      "reused_tokens": best["heads"]["reused_tokens"],
                      "prompt_tokens": sum(map(len, prompts)), "same_bits": same}))
    if not same:
        raise SystemExit("the arms drew different bits: a reused head moved them")


if __name__ == "__main__":
    main()
