"""Digest of each kernel family the pipeline runs, under the kernel settings of this process.

    python benchmarks/kernel_bits.py                  # as the environment is
    python benchmarks/kernel_bits.py --portable       # under numerics: portable's pins
    qemu-x86_64 -cpu Haswell-v4 $(which python) benchmarks/kernel_bits.py --portable

Two machines (or an emulated CPUID, as on the last line) that print the same digest for an
operation compute it with the same bits; where a stage's bits part (`reprorl bitcheck`), this
says which operation does. One thread, float32, fixed random inputs. Last: one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def digest(tensor) -> str:
    data = tensor.detach().contiguous().view(-1)
    import torch

    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--portable", action="store_true", help="pin as numerics: portable")
    args = parser.parse_args()
    if args.portable:
        from reprorl.core import numerics

        numerics.pin("portable")
    import numpy as np
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    torch.set_num_threads(1)
    x = torch.randn(4, 64, 256)
    q = torch.randn(4, 4, 64, 64)
    ops = {
        "matmul 333x257x129 (MKL sgemm)": lambda: torch.randn(333, 257) @ torch.randn(257, 129),
        "matmul 7x64x64": lambda: torch.randn(7, 64) @ torch.randn(64, 64),
        "linear 256->768": lambda: torch.nn.Linear(256, 768)(x),
        "bmm": lambda: torch.bmm(torch.randn(8, 33, 64), torch.randn(8, 64, 47)),
        "softmax": lambda: torch.softmax(x, -1),
        "log_softmax": lambda: torch.log_softmax(x, -1),
        "exp (MKL VML)": lambda: torch.exp(x),
        "tanh": lambda: torch.tanh(x),
        "silu": lambda: F.silu(x),
        "rsqrt": lambda: torch.rsqrt(x.abs() + 1),
        "rms_norm": lambda: F.rms_norm(x, (256,)),
        "sum over rows": lambda: x.sum(-1),
        "sdpa causal": lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
        "cross_entropy": lambda: F.cross_entropy(torch.randn(64, 512), torch.arange(64) % 512),
    }
    digests = {name: digest(op()) for name, op in ops.items()}
    layer = torch.nn.TransformerEncoderLayer(256, 4, 768, batch_first=True, dropout=0.0)
    out = layer(x)
    out.sum().backward()
    digests["encoder layer forward"] = digest(out)
    digests["encoder layer backward"] = digest(
        torch.cat([p.grad.view(-1) for p in layer.parameters()]))
    rng = np.random.default_rng(0)
    counts, sums = rng.multinomial(50, np.full(50, 0.02), size=200), rng.random((50, 7))
    digests["numpy counts @ sums (OpenBLAS)"] = hashlib.sha256(
        (counts @ sums).tobytes()).hexdigest()[:12]
    digests["numpy sum"] = hashlib.sha256(rng.random(1001).sum().tobytes()).hexdigest()[:12]
    for name, value in digests.items():
        print(f"{name:34s} {value}")
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(),
                      "portable": args.portable, "digests": digests}))


if __name__ == "__main__":
    main()
