"""One decode step of a Qwen2- or Llama-family model over the engine's KV slots, written out.

The engine's decode forwards are small (one token for each of 16-64 rows of a tiny model), so
on the CPU the model call's own Python (argument plumbing, decorators, the mask and output
machinery) costs 0.4-1 ms of a 7-20 ms forward at 16-64 rows on the default model, 3-8 %
(`benchmarks/decode_step.py`). `logits` composes the model's own parts instead, in the order
transformers' `Qwen2ForCausalLM` and `LlamaForCausalLM` call them: its modules (embedding,
rotary embedding, norms, projections, MLPs, head) called as they are, and the functions its
attention calls (`apply_rotary_pos_emb`, the attention interface of the model's
`attn_implementation`) given what `Qwen2Attention` (or `LlamaAttention`) gives them. Only the
glue is written here: the layer loop, the residual sums and the heads' reshapes. So the logits
are the model call's, bit for bit (`tests/test_sampling.py` compares every forward of a run,
with and without adapters and grouped queries); `supported` admits only models where nothing
else would run in that call.
"""

from __future__ import annotations

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

# Each family's own functions, and whether its attention passes `sliding_window` (Qwen2's
# does; Llama's has none): the same layer body otherwise, residual sums and norms alike.
FAMILIES = {
    modeling_qwen2.Qwen2ForCausalLM: (modeling_qwen2.apply_rotary_pos_emb,
                                      modeling_qwen2.eager_attention_forward, True),
    modeling_llama.LlamaForCausalLM: (modeling_llama.apply_rotary_pos_emb,
                                      modeling_llama.eager_attention_forward, False),
}


def supported(model) -> bool:
    """transformers' own Qwen2 or Llama causal LM (not a subclass) under SDPA attention, every
    layer attending to the whole past (no sliding window), with nothing attached to the modules
    whose calls `logits` leaves out (a hook, a replaced forward, a compiled call)."""
    config = model.config
    if type(model) not in FAMILIES or config._attn_implementation != "sdpa" or any(
            kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return False
    bypassed = [model, model.model, *model.model.layers,
                *(layer.self_attn for layer in model.model.layers)]
    return not any(module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module)
                   or getattr(module, "_compiled_call_impl", None) is not None
                   for module in bypassed)


def logits(model, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
           layers: list) -> torch.Tensor:
    """The model's logits [rows, 1, vocab] for `ids` [rows, 1] at `positions` [rows, 1] under
    `mask` [rows, 1, 1, length] (as the model's attention takes it, `encoding.mask_for`), each
    layer's keys and values written and read through `layers` (the engine's `SlotLayer`s:
    `update` stores the step's and returns the window's)."""
    inner = model.model
    rotate, eager, sliding = FAMILIES[type(model)]
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(model.config._attn_implementation, eager)
    hidden = inner.embed_tokens(ids)
    rotary = inner.rotary_emb(hidden, positions)
    for layer, slots in zip(inner.layers, layers, strict=True):
        hidden = hidden + attention(layer.self_attn, layer.input_layernorm(hidden), rotary,
                                    mask, slots, attend, rotate, sliding)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(inner.norm(hidden))


def attention(block, x: torch.Tensor, rotary: tuple, mask: torch.Tensor, slots,
              attend, rotate, sliding: bool) -> torch.Tensor:
    """`Qwen2Attention.forward` (or `LlamaAttention.forward`) for one query token a row."""
    rows = x.shape[0]
    shape = (rows, 1, -1, block.head_dim)
    query = block.q_proj(x).view(shape).transpose(1, 2)
    key = block.k_proj(x).view(shape).transpose(1, 2)
    value = block.v_proj(x).view(shape).transpose(1, 2)
    query, key = rotate(query, key, *rotary)
    key, value = slots.update(key, value)
    window = {"sliding_window": block.sliding_window} if sliding else {}
    out, _ = attend(block, query, key, value, mask,
                    dropout=0.0 if not block.training else block.attention_dropout,
                    scaling=block.scaling, **window)
    return block.o_proj(out.reshape(rows, 1, -1).contiguous())
