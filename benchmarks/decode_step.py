"""The engine's decode forward through the model call and written out, side by side.

The embedded server, in process, as `prefill_heads.py` builds it: the profile's base model with
the server's adapter layers and three random LoRA adapters (rank 16), one torch thread, 64 slots
of 512 tokens, rollout prompts in groups of 4 samples of up to 40 tokens. For each row count,
one engine generates that many sequences (three weight versions in flight); every decode forward
runs twice, through the model call (`call`) and through `decode_step.logits` (`written`), in
alternating order, and the two must give the same logits, bit for bit (writing the step's keys
and values twice writes the same bits to the same places). So both arms see the same inputs, the
same caches and the same moment of the machine's drift. The model and corpus come from
`snakemake base_model prepare` when missing.

    python benchmarks/decode_step.py [--rows 16 24 32 48 64]

Printed last, one JSON line: each row count's median milliseconds a forward in each arm and
their ratio (written / call), and whether every forward's logits were the same.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from prefill_heads import GROUP, MAX_LEN, ROOT, SLOTS, served  # the script's own folder

from reprorl.serve.engine import Engine
from reprorl.serve.logprobs import Params
from reprorl.serve.sequence import Sequence

NEW_TOKENS = 40


def measure(model, switches, adapters, prompts, rows: int) -> tuple[dict, bool]:
    """`rows` sequences through one engine, every decode forward in both arms."""
    engine = Engine(model, switches, SLOTS, SLOTS * MAX_LEN, MAX_LEN)
    engine.warm_up()
    assert engine.written_out, "the written-out step does not support this model"
    params = Params(max_tokens=NEW_TOKENS, temperature=1.0, logprobs=1, eos_id=-1)
    seqs = [Sequence(list(prompts[i // GROUP]), params, adapters[i // (2 * GROUP) % 3],
                     torch.Generator().manual_seed(i)) for i in range(rows)]
    times: dict[str, list[float]] = {"call": [], "written": []}
    same = [True]
    decode_slots = engine.decode_slots

    def both(first, end, members):
        results = {}
        order = ("call", "written") if len(times["call"]) % 2 else ("written", "call")
        for arm in order:
            engine.written_out = arm == "written"
            started = time.perf_counter()
            results[arm] = decode_slots(first, end, members)
            times[arm].append(time.perf_counter() - started)
        same[0] &= all(torch.equal(results["call"][slot], results["written"][slot])
                       for slot in results["call"])
        return results["written"]
    engine.decode_slots = both
    engine.generate(seqs)
    return {arm: 1000 * statistics.median(spent) for arm, spent in times.items()}, same[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/default.yaml"))
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 24, 32, 48, 64])
    args = parser.parse_args()
    prompts, (model, switches, adapters) = served(args.config)
    figures, same = {}, True
    with torch.inference_mode():
        for rows in args.rows:
            ms, alike = measure(model, switches, adapters, prompts, rows)
            same &= alike
            figures[rows] = {"call_ms": round(ms["call"], 3),
                             "written_ms": round(ms["written"], 3),
                             "ratio": round(ms["written"] / ms["call"], 3)}
            print(f"{rows} rows: call {ms['call']:.2f} ms, written out {ms['written']:.2f} ms "
                  f"a decode forward ({figures[rows]['ratio']:.3f}x the time), same logits: "
                  f"{alike}", flush=True)
    print(json.dumps({"decode_ms": figures, "same_logits": same}))


if __name__ == "__main__":
    main()
