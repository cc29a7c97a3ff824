"""Tree packing: a row's samples as one prefix trie, laid out depth-first, and its mask.

A row holds the token ids of its samples as a prefix trie: a prefix that several samples
share (a group's prompt, a chat template's opening, the conversation a later turn repeats) is
one path of nodes, and each sample is a path from the root. A row is laid out as one sequence,
its trie in depth-first order (children in the order they were first inserted, so the same
samples in the same order give the same layout):
- `position_ids`: a token's depth in the trie, i.e. its position in every sample through it,
  so positions restart along each branch;
- the attention mask: token q sees token k iff k is q or one of its ancestors. In depth-first
  order the subtree of k is the range [k, end[k]), so `mask[q, k] = k <= q < end[k]`;
- nothing is padded: each row is a forward of its own length.
Attention with that mask makes each token's context exactly its own sample's prefix: its
log-probabilities are those of forwarding the sample alone (up to float reduction order).
The token before a fork is shared too: the loss gathers each sample's predictions by index
(`MicroBatch.index`), so one position may predict the first token of every branch below it.
"""

from __future__ import annotations

import torch


def attention_pairs(depth: int) -> int:
    """Query-key pairs of the tokens at depths 0..depth-1 of one path: 1 + 2 + ... + depth."""
    return depth * (depth + 1) // 2


class Row:
    """One packed row: the prefix trie of its samples' token ids. Node 0 is the root (no
    token); every other node is one forwarded token."""

    def __init__(self):
        self.children: list[dict[int, int]] = [{}]  # node -> {token id: child node}
        self.token: list[int] = [-1]
        self.depth: list[int] = [-1]
        self.parent: list[int] = [-1]
        self.samples: list = []
        self.paths: list[list[int]] = []  # per sample: the node of each of its tokens
        self.cost = 0  # attention pairs: a token at depth d attends to d + 1 tokens

    @property
    def tokens(self) -> int:
        return len(self.token) - 1

    def shared(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` the row holds already."""
        node = 0
        for count, token in enumerate(ids):
            node = self.children[node].get(token)
            if node is None:
                return count
        return len(ids)

    def added(self, ids: list[int]) -> tuple[int, int]:
        """The tokens and the attention cost that inserting `ids` would add."""
        shared = self.shared(ids)
        return len(ids) - shared, attention_pairs(len(ids)) - attention_pairs(shared)

    def add(self, sample) -> None:
        ids = sample.sequence.input_ids
        self.cost += self.added(ids)[1]
        node, path = 0, []
        for depth, token in enumerate(ids):
            child = self.children[node].get(token)
            if child is None:
                child = len(self.token)
                self.children[node][token] = child
                self.children.append({})
                self.token.append(token)
                self.depth.append(depth)
                self.parent.append(node)
            path.append(child)
            node = child
        self.samples.append(sample)
        self.paths.append(path)

    def depth_first(self) -> tuple[list[int], list[int]]:
        """Nodes in depth-first order, and each node's place in that order (root excluded)."""
        order, stack = [], list(reversed(self.children[0].values()))
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(self.children[node].values()))
        place = [-1] * len(self.token)
        for index, node in enumerate(order):
            place[node] = index
        return order, place


def lay_out(row: Row) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """The row as one sequence: input ids (1, L), position ids (1, L), the tree mask
    (1, 1, L, L; True where a query may see a key) and, per sample, the index of each of its
    tokens in the sequence."""
    order, place = row.depth_first()
    size = [1] * len(row.token)  # subtree sizes: children were created after their parents
    for node in range(len(row.token) - 1, 0, -1):
        size[row.parent[node]] += size[node]
    index = torch.arange(len(order))
    end = torch.tensor([place[n] + size[n] for n in order], dtype=torch.long)
    mask = (index[None, :] <= index[:, None]) & (index[:, None] < end[None, :])
    return (torch.tensor([[row.token[n] for n in order]], dtype=torch.long),
            torch.tensor([[row.depth[n] for n in order]], dtype=torch.long), mask[None, None],
            [[place[n] for n in path] for path in row.paths])
