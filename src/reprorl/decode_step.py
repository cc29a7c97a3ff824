"""One decode step of a Qwen2-family model over the engine's KV slots, written out.

The engine's decode forwards are small (one token for each of 16-64 rows of a tiny model), so
on the CPU the model call's own Python (argument plumbing, decorators, the mask and output
machinery) costs 0.5-1 ms of a 6-14 ms forward at 16-64 rows on the default model, 5-10 %
(`benchmarks/decode_step.py`).
`logits` runs the same operations in the same order on the same modules instead: the
embedding, rotary embedding, RMSNorms and MLPs are the model's own modules, called as they are;
only the attention block is written out, as transformers' `Qwen2Attention` and
`sdpa_attention_forward` compute it for one query token under a 4-D boolean mask (a query of
grouped heads reshaped onto its key/value heads, `pack_gqa`). So the logits are the model
call's, bit for bit (`tests/test_sampling.py` compares them at every row count it reaches,
with and without adapters). `supported` says where that holds by construction; any other
model goes through the model call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM, rotate_half


def supported(model) -> bool:
    """transformers' own Qwen2 causal LM (not a subclass or a wrapper, whose call may do more)
    under SDPA attention, every layer attending to the whole past (no sliding window): what
    `logits` writes out."""
    config = model.config
    return (type(model) is Qwen2ForCausalLM and config._attn_implementation == "sdpa"
            and all(kind == "full_attention" for kind in config.layer_types))


def logits(model, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
           layers: list) -> torch.Tensor:
    """The model's logits [rows, 1, vocab] for `ids` [rows, 1] at `positions` [rows, 1] under
    `mask` [rows, 1, 1, length] (boolean: may attend), each layer's keys and values written
    and read through `layers` (the engine's `SlotLayer`s: `update` stores the step's and
    returns the window's)."""
    inner = model.model
    hidden = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(hidden, positions)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # over the heads
    for layer, slots in zip(inner.layers, layers):
        hidden = hidden + attention(layer.self_attn, layer.input_layernorm(hidden), cos, sin,
                                    mask, slots)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(inner.norm(hidden))


def attention(block, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              mask: torch.Tensor, slots) -> torch.Tensor:
    """`Qwen2Attention.forward` for one query token a row, through SDPA."""
    rows, head_dim = x.shape[0], block.head_dim
    query = block.q_proj(x).view(rows, 1, -1, head_dim).transpose(1, 2)
    key = block.k_proj(x).view(rows, 1, -1, head_dim).transpose(1, 2)
    value = block.v_proj(x).view(rows, 1, -1, head_dim).transpose(1, 2)
    query = (query * cos) + (rotate_half(query) * sin)
    key = (key * cos) + (rotate_half(key) * sin)
    key, value = slots.update(key, value)
    groups = block.num_key_value_groups
    if groups > 1:  # the query heads that share a key/value head as that head's queries
        query = query.reshape(rows, query.shape[1] // groups, groups, head_dim)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=0.0,
                                         scale=block.scaling, is_causal=False)
    out = out.reshape(rows, -1, 1, head_dim).transpose(1, 2).contiguous()
    return block.o_proj(out.reshape(rows, 1, -1).contiguous())
