"""The server's engine with and without the column-major weight reads, side by side.

The embedded server in process, as `benchmarks/prefill_heads.py` builds it: the profile's base
model with the server's adapter layers and three random LoRA adapters (rank 16), one torch
thread, the first 48 rollout prompts of the corpus as the GRPO worker renders them, 4 samples
each, 64 slots of 512 tokens, with 40 new tokens each here. Arm `columns`: today's engine,
whose LoRA target projections read a column-major copy of their weight at the row counts where
that gives the layer's own bits (`weights.Switch.product`, `invariance.linear`); arm
`rows`: the same engine with every projection computed by its `nn.Linear` (the row-major
weight). Both arms must draw the same tokens and log-probs, bit for bit; the rounds alternate.
The model and corpus come from `snakemake base_model prepare` when missing.

    python benchmarks/columns.py [--rounds 4]

Printed last, one JSON line: each arm's best round by total seconds, its total and prefill
seconds (the first `columns` round also compares the two reads at each row count's first
product), and the speedups between those rounds.
"""

from __future__ import annotations

import json

import torch
from prefill_heads import alternate, arguments, run, seconds, served  # the script's folder

from reprorl.serve.weights import Switch

NEW_TOKENS = 40


def main() -> None:
    args = arguments(__doc__, 4)
    prompts, (model, switches, adapters) = served(args.config)
    columns = Switch.product

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x)

    def arm(product):
        def call() -> dict:
            Switch.product = product
            try:
                return run(model, switches, adapters, prompts, True, NEW_TOKENS)
            finally:
                Switch.product = columns
        return call

    best, same = alternate(args.rounds, {"rows": arm(rows), "columns": arm(columns)},
                           "total_s")
    print(json.dumps({**seconds(best),
                      "speedup": round(best["rows"]["total_s"] / best["columns"]["total_s"], 3),
                      "prefill_speedup": round(best["rows"]["prefill_s"]
                                               / best["columns"]["prefill_s"], 3),
                      "same_bits": same}))
    if not same:
        raise SystemExit("the arms drew different bits: a column-major read moved them")


if __name__ == "__main__":
    main()
