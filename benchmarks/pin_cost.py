"""Which portable pin costs the time: a training step and a decode forward of the embedded
model's shape, native, with every pin, and with every pin but one, side by side.

    python benchmarks/pin_cost.py [--repeats 6]

Each setting runs in a fresh process (the pins are read when torch loads), one torch thread,
AdamW fused as the stages build it. Prints each setting's milliseconds and its ratio to native,
last one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from reprorl.core.numerics import PORTABLE

STEP = """
import json, os, sys, time, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
torch.manual_seed(0); torch.set_num_threads(1)
config = Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=768,
                     num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=512)
model = Qwen2ForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
ids = torch.randint(0, 1024, (8, 128))
def step():
    model(input_ids=ids, labels=ids).loss.backward(); optimizer.step(); optimizer.zero_grad()
step(); step()
started = time.perf_counter()
for _ in range(int(sys.argv[1])): step()
train = (time.perf_counter() - started) / int(sys.argv[1])
with torch.no_grad():
    rows = ids[:, :1].repeat(2, 1)
    started = time.perf_counter()
    for _ in range(20): model(input_ids=rows)
    decode = (time.perf_counter() - started) / 20
print(json.dumps({"train_ms": 1000 * train, "decode_ms": 1000 * decode,
                  "capability": torch.backends.cpu.get_cpu_capability()}))
"""


def measure(env: dict, repeats: int) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in PORTABLE}
    answer = subprocess.run([sys.executable, "-c", STEP, str(repeats)], env={**clean, **env},
                            capture_output=True, text=True, check=True)
    return json.loads(answer.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    settings = {"native": {}, "portable": dict(PORTABLE)}
    settings |= {f"portable but {key}": {k: v for k, v in PORTABLE.items() if k != key}
                 for key in PORTABLE}
    results = {}
    for name, env in settings.items():
        results[name] = measure(env, args.repeats)
        base = results["native"]
        print(f"{name:42s} train {results[name]['train_ms']:7.1f} ms "
              f"({results[name]['train_ms'] / base['train_ms']:.2f}x)  decode "
              f"{results[name]['decode_ms']:6.1f} ms "
              f"({results[name]['decode_ms'] / base['decode_ms']:.2f}x)", flush=True)
    native = results["native"]
    print(json.dumps({name: {"train_ratio": round(r["train_ms"] / native["train_ms"], 3),
                             "decode_ratio": round(r["decode_ms"] / native["decode_ms"], 3)}
                      for name, r in results.items()}))


if __name__ == "__main__":
    main()
