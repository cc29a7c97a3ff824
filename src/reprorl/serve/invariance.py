"""Where a row's bits do not depend on what runs beside it: probes, asked once per process.

The engine promises that a sequence's tokens and log-probs are bitwise the same whatever is
batched beside it. That rests on facts of this CPU, its libraries and the thread count, which
differ from machine to machine, so the engine asks instead of assuming:
- `rows_invariant`: each row of the model's products keeps its bits at every row count from
  SPAN_ROWS up, and each item of a batched LoRA product is what it gives alone. Where it holds,
  a decode forward spans the slots in use and stacks its rows' adapters (`Engine.span`,
  `Engine.stacked`); elsewhere the engine decodes by fixed groups of rows.
- `heads_invariant`: a prompt forwarded after the KV of a head it shares with a recent prompt
  gets the bits of its own whole forward (`Engine.shared_head`).
- `linear`: a linear layer's product from a column-major copy of its weight, which is faster,
  at the row counts where a probe finds the layer's own bits (`weights.Switch`).
Each probe runs the model's own weights on random inputs. `forward_prompt`, the engine's prompt
forward, lives here because the head probe must test exactly the function the engine runs.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math

import torch
from transformers.cache_utils import DynamicCache

from reprorl.core import devices

log = logging.getLogger("reprorl.serve")

# On this project's Intel Xeon with one torch thread, for the products of the CI, default and
# Qwen2.5-0.5B shapes in float32: a row's result is bitwise the same at every row count from
# 16 up (to 512; SDPA's at any count), and each item of a batched product is what that
# product alone gives. With two threads neither holds. Where `rows_invariant` finds both (one
# CPU thread), a decode forward spans the slots in use (`Engine.span`) and runs its rows'
# adapters in one batched product (`adapters.stack_adapters`); elsewhere it decodes by groups.
SPAN_ROWS = 16
SPAN_PROBE = (16, 17, 40)  # the row counts `rows_invariant` compares
# A prompt reuses the KV of a head it shares with a recent one in whole blocks of 32 tokens,
# both prompts under 192 tokens, 16 or more left to forward: under 192 queries PyTorch's CPU
# attention splits them in blocks of 32 rows and keys in one block, so each row of the rest
# meets the same query block as in the prompt's whole forward, and the products' rows keep
# their bits from 16 rows up. With other heads the bits moved (measured: a row in a query
# block of under 16 rows in one forward and of 32 in the other).
HEAD_BLOCK, HEAD_LIMIT = 32, 192
# nn.Linear keeps its weight [out, in] row-major, which the CPU GEMM reads transposed; from a
# column-major copy ([in, out] contiguous) MKL multiplies faster at the engine's row counts
# (benchmarks/records/mm-columns-xeon-2aa3327.log). On the Intel Xeon (float32, one thread) the
# two reads give the same bits at every count from 16 rows up (the default model's shapes,
# probed to 256) and at 1 to 5, not from 6 up to 10 or 14 (by shape), where MKL takes another
# path. `linear` probes each row count before it reads the copy there.
AGREEMENT: dict[tuple, dict[int, bool]] = {}  # (shape, bias, threads) -> {rows: same bits}


PROBED: dict[tuple, bool] = {}  # `rows_invariant`, `heads_invariant` by shapes and threads


def rows_invariant(model, rank: int = 16) -> bool:
    """Whether here (this CPU, its library, the current thread count) each row of the model's
    products has the same bits at every count of SPAN_PROBE rows, each item of a batched
    LoRA product at each count is what its two products alone give, and those products'
    rows are the same at every count too: what `Engine.span`, `Engine.stacked` and (a prompt
    with an adapter forwarding its rest only) `Engine.shared_head` rest on. A probe of the
    model's own weights on random rows, once per process for each set of shapes."""
    linears = {m.weight.shape: m.weight for m in model.modules()
               if isinstance(m, torch.nn.Linear)}
    key = (tuple(sorted(linears)), next(iter(linears.values())).dtype, rank,
           torch.get_num_threads())
    if key not in PROBED:
        PROBED[key] = probe_rows(linears, rank)
    return PROBED[key]


def probe_rows(linears: dict, rank: int) -> bool:
    """`rows_invariant` for the products of these weights (by shape) and LoRAs of `rank`."""
    generator = torch.Generator().manual_seed(0)
    least, most = SPAN_PROBE[0], max(SPAN_PROBE)
    for (outputs, inputs), weight in linears.items():
        x = torch.randn(most, inputs, generator=generator)
        # every row, the last ones too: MKL's vendor-neutral path (numerics: portable) computes
        # the rows past the last whole block of 4 with other code, so a row's bits follow its
        # slot's place in the span, which the first rows alone never show
        every = torch.nn.functional.linear(x.to(weight), weight)
        a = torch.randn(2, rank, inputs, generator=generator) / inputs ** 0.5
        b = torch.randn(2, outputs, rank, generator=generator) / rank ** 0.5
        lora = torch.nn.functional.linear(torch.nn.functional.linear(x[:least], a[0]), b[0])
        for count in SPAN_PROBE:
            rows = torch.nn.functional.linear(x[:count].to(weight), weight)
            items = torch.bmm(torch.bmm(x[:count].expand(2, count, inputs), a.transpose(1, 2)),
                              b.transpose(1, 2))
            if not torch.equal(rows, every[:count]) or not torch.equal(
                    items[0, :least], lora) or not all(
                    torch.equal(items[k], torch.nn.functional.linear(
                        torch.nn.functional.linear(x[:count], a[k]), b[k])) for k in range(2)):
                return False
    return True


def linear(layer: torch.nn.Linear, x: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """`layer(x)`, bit for bit: from `columns`, the weight's column-major copy, at a row count
    where the two reads gave the same bits on a random input through the layer's weights
    (probed at the count's first product, once per process for each shape, bias and thread
    count), else from the layer itself. Only a 2-D or 3-D input that is contiguous and 64-byte
    aligned, as PyTorch allocates (MKL's bits may follow the alignment), reads the copy."""
    if x.dim() not in (2, 3) or not x.is_contiguous() or x.data_ptr() % 64:
        return layer(x)
    rows = math.prod(x.shape[:-1])
    key = (tuple(columns.shape), layer.bias is not None, torch.get_num_threads())
    agreement = AGREEMENT.setdefault(key, {})
    if rows not in agreement:
        generator = torch.Generator().manual_seed(rows)
        probe = torch.randn(x.shape, generator=generator, dtype=x.dtype)
        agreement[rows] = torch.equal(layer(probe), column_product(probe, columns, layer.bias))
    return column_product(x, columns, layer.bias) if agreement[rows] else layer(x)


def column_product(x: torch.Tensor, columns: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    """`linear(x, weight, bias)` from `columns` (`weight.t().contiguous()`), `x` contiguous."""
    flat = x.reshape(-1, x.shape[-1])
    out = flat @ columns if bias is None else torch.addmm(bias, flat, columns)
    return out.reshape(*x.shape[:-1], columns.shape[1])


# (head, prompt, source) lengths `heads_invariant` compares: one and two blocks reused, the
# least rest (16 rows), the longest prompt and source, a source shorter than the prompt
HEAD_PROBE = ((HEAD_BLOCK, 72, 80), (2 * HEAD_BLOCK, 100, 70), (HEAD_BLOCK, 48, 191),
              (3 * HEAD_BLOCK, HEAD_LIMIT - 1, 120))


def heads_invariant(model) -> bool:
    """Whether here a prompt forwarded after the KV of a head it shares with another prompt
    gets the bits of its own whole forward (KV and last logits), on `Engine.shared_head`'s
    terms. The products' rows keep their bits at such counts (`rows_invariant`); this probes
    the attention too, whose products see other row counts and key lengths in the two
    forwards, on the model's own weights and random tokens (HEAD_PROBE), once per process
    for each architecture, attention, dtype and thread count. An error counts as a no."""
    key = ("heads", type(model).__name__, model.config.to_json_string(),
           getattr(model.config, "_attn_implementation", None), next(model.parameters()).dtype,
           torch.get_num_threads())
    if key not in PROBED:
        generator = torch.Generator().manual_seed(0)
        vocab, device = model.config.vocab_size, devices.of(model)
        same = True
        try:
            for head, length, source in HEAD_PROBE:
                other = torch.randint(vocab, (source,), generator=generator).tolist()
                tokens = other[:head] + torch.randint(
                    vocab, (length - head,), generator=generator).tolist()
                with torch.inference_mode():
                    whole = forward_prompt(model, tokens, device)
                    reused = forward_prompt(model, tokens, device,
                                            forward_prompt(model, other, device)[1], head)
                same = same and torch.equal(whole[0], reused[0]) and all(
                    torch.equal(a, b) for pair, again in zip(whole[1], reused[1])
                    for a, b in zip(pair, again))
        except Exception:  # noqa: BLE001 (this model's cache path failed: no reuse)
            log.exception("probing a prompt's prefill after a reused head failed")
            same = False
        PROBED[key] = same
    return PROBED[key]


def forward_prompt(model, tokens: list[int], device: torch.device,
                   head: list[tuple[torch.Tensor, torch.Tensor]] | None = None, reused: int = 0
                   ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A prompt's forward: its last logits and its per-layer (keys, values), [kv heads,
    its length, head dim]. With `head` (another prompt's per-layer KV), that KV's first
    `reused` positions stand for the prompt's own, and only the tokens after them run."""
    name, cache = cache_argument(model), None
    if reused:
        cache = DynamicCache(config=model.config)  # updates concatenate: `head` stays as it is
        for index, (keys, values) in enumerate(head):
            cache.update(keys[None, :, :reused], values[None, :, :reused], index)
    output = model(input_ids=torch.tensor([tokens[reused:]], device=device), use_cache=True,
                   logits_to_keep=1, **{} if cache is None else {name: cache})
    return output.logits[0, -1], [(layer.keys[0], layer.values[0])
                                  for layer in output[name].layers]


def cache_argument(model) -> str:
    """The forward argument that takes a KV cache (transformers 5.2x renamed it)."""
    return _cache_argument(type(model))


@functools.lru_cache(maxsize=None)
def _cache_argument(kind: type) -> str:  # once per model class: every prefill asks
    return "cache" if "cache" in inspect.signature(kind.forward).parameters else (
        "past_key_values")
