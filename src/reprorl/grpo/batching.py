"""Micro-batches of samples within a token budget, as left-padded tensors.

`PaddedBatcher` is the one interface the trainer batches through; the tree-packing release
replaces it. Here a micro-batch is one padded block: its forwarded tokens (rows x longest row,
padding included) stay within `token_budget`, and it holds `per_device_train_batch_size`
samples at most. A sample longer than the budget fits nowhere and is refused by `oversize`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (B, L) left-padded
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    trained: torch.Tensor  # (B, W) bool, for the last W tokens
    targets: torch.Tensor  # (B, W) the last W tokens
    sampler_logp: torch.Tensor  # (B, W)
    top_ids: torch.Tensor  # (B, W, K) sampler top tokens (0 where missing)
    top_sampler_logp: torch.Tensor  # (B, W, K) their sampler log-probs (-inf where missing)
    advantages: torch.Tensor  # (B,)
    width: int  # W: trained tokens all lie in the last W columns

    @property
    def forwarded_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def real_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def attention_cost(self) -> int:
        """Attention cost of the micro-batch: rows x length squared (pads are forwarded)."""
        rows, length = self.input_ids.shape
        return rows * length * length


class PaddedBatcher:
    def __init__(self, token_budget: int, max_samples: int, top_k: int, pad_id: int):
        self.token_budget, self.max_samples = token_budget, max_samples
        self.top_k, self.pad_id = max(top_k, 1), pad_id

    def oversize(self, sample) -> bool:
        return sample.tokens > self.token_budget

    def fits(self, samples: list, sample) -> bool:
        if len(samples) >= self.max_samples:
            return False
        longest = max([s.tokens for s in samples] + [sample.tokens])
        return (len(samples) + 1) * longest <= self.token_budget

    def collate(self, samples: list) -> MicroBatch:
        length = max(s.tokens for s in samples)
        first_trained = [s.sequence.trained.index(1) for s in samples]
        width = max(s.tokens - f for s, f in zip(samples, first_trained))
        rows = len(samples)
        ids = torch.full((rows, length), self.pad_id, dtype=torch.long)
        attention = torch.zeros((rows, length), dtype=torch.long)
        trained = torch.zeros((rows, length), dtype=torch.bool)
        sampler = torch.zeros((rows, length))
        top_ids = torch.zeros((rows, length, self.top_k), dtype=torch.long)
        top_logp = torch.full((rows, length, self.top_k), float("-inf"))
        for r, s in enumerate(samples):
            seq, start = s.sequence, length - s.tokens
            ids[r, start:] = torch.tensor(seq.input_ids)
            attention[r, start:] = 1
            trained[r, start:] = torch.tensor(seq.trained, dtype=torch.bool)
            sampler[r, start:] = torch.tensor(seq.sampler_logprobs)
            for t, top in enumerate(seq.sampler_top):
                if top:
                    best = sorted(top.items(), key=lambda kv: -kv[1])[: self.top_k]
                    top_ids[r, start + t, : len(best)] = torch.tensor([k for k, _ in best])
                    top_logp[r, start + t, : len(best)] = torch.tensor([v for _, v in best])
        positions = (attention.cumsum(1) - 1).clamp(min=0)
        tail = slice(length - width, length)
        return MicroBatch(ids, attention, positions, trained[:, tail], ids[:, tail],
                          sampler[:, tail], top_ids[:, tail], top_logp[:, tail],
                          torch.tensor([s.advantage for s in samples], dtype=torch.float32),
                          width)
