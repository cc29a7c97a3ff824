"""`reprorl serve`'s flags: vLLM's names where vLLM has the flag, each with its range."""

from __future__ import annotations

import argparse

from reprorl.core import numerics

from .invariance import SPAN_ROWS


def count(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high]."""
    def parse(text: str) -> int:
        value = int(text)  # not a number: argparse names the flag and the value
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="reprorl serve", description="A vLLM-compatible generation server, one process.")
    add = parser.add_argument
    add("--model", required=True, help="Hugging Face model directory")
    add("--served-model-name", default=None, help="model name in the API (default: --model)")
    add("--host", default="127.0.0.1")
    add("--port", type=count(0, 65535), default=8000, help="0 picks a free port")
    add("--port-file", default=None, help="write the bound port here once listening")
    add("--api-key", nargs="+", default=None,
        help="require one of these Bearer keys on /v1/* (default: $VLLM_API_KEY, if set)")
    add("--lora-root", default=None,
        help="load adapters only from below this directory (default: anywhere)")
    add("--max-model-len", type=count(1), default=None, help="default: max_position_embeddings")
    add("--max-num-seqs", type=count(1), default=64, help="running sequences at most")
    add("--decode-rows", type=count(1), default=SPAN_ROWS,
        help="rows of a decode group: a forward decodes one group, a fixed shape, or with "
             f"one thread and {SPAN_ROWS} rows or more every group in use (batch invariance)")
    add("--max-waiting-requests", type=count(1), default=1024,
        help="queued requests at most; more are refused with 503")
    add("--max-request-bytes", type=count(1024), default=2 << 20,
        help="request body size at most; larger ones are refused with 413")
    add("--kv-cache-tokens", type=count(1), default=32768, help="KV-cache capacity in tokens")
    add("--max-loras", type=count(1), default=6)
    add("--max-lora-rank", type=count(1), default=16)
    add("--max-logprobs", type=count(0), default=20)
    add("--enable-scale-out", action="store_true",
        help="serve vLLM's token-in/token-out /inference/v1/generate")
    add("--return-sampling-mask", action="store_true",
        help="return each sampled token's candidate set (top-k/top-p/min-p) from generate")
    add("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="float32",
        help="auto: the checkpoint's dtype")
    add("--threads", type=count(1), default=1, help="torch threads")
    add("--device", default="cpu",
        help="auto, cpu, cuda or cuda:N (a BF16-capable GPU, deterministic algorithms on)")
    add("--trust-remote-code", action="store_true", help="allow the model's own code")
    add("--seed", type=int, default=0)
    add("--ignore-job-signals", action="store_true",
        help="ignore SIGTERM and SIGUSR1 (a cluster's signals to every process of a job) and "
             "stop on SIGINT: for a server whose parent stops it, as a GRPO trainer does")
    # read by `reprorl serve` before torch loads (reprorl.core.numerics); a child of a stage
    # inherits its stage's mode instead
    add("--numerics", choices=numerics.MODES, default=None,
        help="portable: AVX2 kernels pinned, the same bits on any x86-64 CPU with AVX2")
    return parser.parse_args(argv)
