"""Explicit LoRA against PEFT (the oracle), parameter counts, PEFT-format export."""

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from reprorl.model import lora

QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                tie_word_embeddings=True)


def test_adapter_count_at_qwen_05b_dimensions_on_meta():
    config = Qwen2Config(**QWEN_05B)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    count = lora.inject(model, rank=8, alpha=16, seed=49)
    assert count == 4_399_104 == lora.expected_parameter_count(config, 8)
    assert sum(isinstance(m, lora.LoRALinear) for m in model.modules()) == 168


def tiny_model(dtype=torch.float32, seed=0):
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).to(dtype).eval()


def ours_and_peft(dtype):
    from peft import LoraConfig, get_peft_model

    base = tiny_model(dtype)
    ours = copy.deepcopy(base)
    count = lora.inject(ours, rank=8, alpha=16, seed=49)
    ours.requires_grad_(False)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():  # non-zero B so the branch matters
        for module in ours.modules():
            if isinstance(module, lora.LoRALinear):
                module.lora_B.normal_(0, 0.1, generator=generator)
    for name, parameter in ours.named_parameters():
        parameter.requires_grad_(lora.is_adapter(name))
    peft = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(lora.TARGETS)))
    peft_params = dict(peft.named_parameters())
    with torch.no_grad():
        for key, tensor in lora.peft_state(ours).items():
            peft_params[key.replace(".weight", ".default.weight")].copy_(tensor)
    return ours, peft, count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_and_gradients_match_peft(dtype):
    ours, peft, count = ours_and_peft(dtype)
    assert count == lora.expected_parameter_count(ours.config, 8)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    mine = ours(input_ids=ids).logits
    theirs = peft(input_ids=ids).logits
    assert mine.dtype == theirs.dtype == dtype  # the sum is cast back to the base dtype
    assert torch.equal(mine, theirs)
    mine.float().square().mean().backward()
    theirs.float().square().mean().backward()
    peft_params = dict(peft.named_parameters())
    for name, parameter in ours.named_parameters():
        if lora.is_adapter(name):
            module, _, matrix = name.rpartition(".")
            other = peft_params[f"base_model.model.{module}.{matrix}.default.weight"]
            assert parameter.grad.dtype == torch.float32  # the branch runs in FP32
            torch.testing.assert_close(parameter.grad, other.grad, rtol=1e-5, atol=1e-7)


def test_base_is_frozen_and_fresh_adapter_is_identity():
    base = tiny_model()
    wrapped = copy.deepcopy(base)
    lora.inject(wrapped, 8, 16, seed=49)
    ids = torch.arange(10).unsqueeze(0)
    assert torch.equal(base(input_ids=ids).logits, wrapped(input_ids=ids).logits)  # B = 0
    frozen = [n for n, p in wrapped.named_parameters() if not lora.is_adapter(n)]
    assert all(not dict(wrapped.named_parameters())[n].requires_grad for n in frozen)


def test_same_seed_same_adapters_other_seed_differs():
    a, b, c = tiny_model(), tiny_model(), tiny_model()
    for model, seed in ((a, 49), (b, 49), (c, 50)):
        lora.inject(model, 8, 16, seed)
    first = lora.peft_state(a)
    assert all(torch.equal(first[k], v) for k, v in lora.peft_state(b).items())
    assert any(not torch.equal(first[k], v) for k, v in lora.peft_state(c).items())


def test_peft_export_loads_in_peft_with_same_logits(tmp_path):
    from peft import PeftModel

    ours, _, _ = ours_and_peft(torch.float32)
    lora.export_peft(ours, tmp_path / "adapter", "tiny", rank=8, alpha=16)
    loaded = PeftModel.from_pretrained(tiny_model(), tmp_path / "adapter").eval()
    ids = torch.arange(12).unsqueeze(0)
    assert torch.equal(ours(input_ids=ids).logits, loaded(input_ids=ids).logits)
    again = tiny_model()
    lora.inject(again, 8, 16, seed=7)
    lora.load_peft_into(again, tmp_path / "adapter")
    assert torch.equal(ours(input_ids=ids).logits, again(input_ids=ids).logits)


@pytest.mark.parametrize("rows", [1, 4, 16, 40])
@pytest.mark.parametrize("shape", [(64, 128), (256, 768), (768, 256), (896, 4864)])
def test_row_adapters_give_each_row_what_its_adapter_gives_it_bitwise(rows, shape, one_thread):
    """The generation server's batched branch (`with_row_adapters`: every adapter over all
    rows in one `bmm`, each row keeping its own) against `with_adapter` row by row, with one
    torch thread (where the engine stacks adapters): the same bits, at the CI, default and
    Qwen2.5-0.5B shapes, with scales that are not powers of two (rsLoRA's alpha / sqrt r)."""
    inputs, outputs = shape
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1, inputs, generator=generator)
    result = torch.randn(rows, 1, outputs, generator=generator)
    adapters = [(torch.randn(8, inputs, generator=generator) * 0.1,
                 torch.randn(outputs, 8, generator=generator) * 0.1, scale)
                for scale in (2.0, 16 / 8 ** 0.5, 0.3)]
    which = torch.randint(-1, len(adapters), (rows,), generator=generator)  # -1: no adapter
    a = torch.stack([a for a, _, _ in adapters]).transpose(1, 2)
    b = torch.stack([b for _, b, _ in adapters]).transpose(1, 2)
    scale = torch.tensor([adapters[k][2] if k >= 0 else 0.0 for k in which]).view(rows, 1, 1)
    pick = which.clamp(min=0) * rows + torch.arange(rows)
    batched = lora.with_row_adapters(result, x, a, b, pick, scale)
    for row, k in enumerate(which.tolist()):
        expected = result[row] if k < 0 else lora.with_adapter(
            result, x, *adapters[k])[row]  # the whole batch, as the engine ran it before
        assert torch.equal(batched[row], expected), (row, k)
