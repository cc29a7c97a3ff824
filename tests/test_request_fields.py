"""vLLM's request fields as the embedded server reads them, without a server: pydantic's lax
booleans, logit bias, bad words, and the sampler steps they drive (allowed tokens, bad words,
min tokens, bias, frequency and presence penalties), each against a hand computation."""

from __future__ import annotations

import math

import pytest
import torch

from reprorl.serve.api import ApiError, bad_word_ids, boolean, logit_bias, sampling_params
from reprorl.serve.logprobs import Params, processed_logprobs


@pytest.mark.parametrize(("value", "read"), [
    (True, True), (False, False), ("false", False), ("False", False), ("true", True),
    ("yes", True), ("off", False), ("0", False), ("1", True), (0, False), (1, True),
    (None, False)])
def test_booleans_are_read_as_vllms_request_models_read_them(value, read):
    assert boolean({"ignore_eos": value}, "ignore_eos", False) is read


@pytest.mark.parametrize("value", ["maybe", 2, 0.5, [], {}])
def test_a_value_that_is_no_boolean_is_refused_by_name(value):
    with pytest.raises(ApiError, match="'ignore_eos' must be a boolean") as error:
        boolean({"ignore_eos": value}, "ignore_eos", False)
    assert error.value.status == 400 and error.value.param == "ignore_eos"


def settings(**body):
    return sampling_params(body, prompt_len=4, max_len=64, max_logprobs=5, eos_id=2,
                           extra_eos=set(), vocab=10, encode=WORDS.get)


WORDS = {"ab": [4, 5], " ab": [6, 5], "c": [7], " c": [7], "de": [8, 9], " de": [1]}


def test_ignore_eos_as_the_string_false_keeps_the_end_token():
    assert settings(ignore_eos="false").eos_id == 2
    assert settings(ignore_eos="true").eos_id is None


def test_logit_bias_keys_are_token_ids_and_biases_are_clipped():
    assert logit_bias({"logit_bias": {"3": 5.5, "1": -500}}, 10) == ((1, -100.0), (3, 5.5))
    for bad, message in (({"x": 1}, "not a token id"), ({"10": 1}, "out-of-vocab"),
                         ({"3": "high"}, "must be a number")):
        with pytest.raises(ApiError, match=message):
            logit_bias({"logit_bias": bad}, 10)


def test_bad_words_take_the_spaced_form_only_where_it_is_another_word():
    # " ab" starts with another token, as long as "ab": both barred; " c" is "c"; " de" is
    # shorter than "de", so vLLM keeps "de" alone
    assert bad_word_ids(["ab", "c", "de"], WORDS.get, 10) == ((4, 5), (6, 5), (7,), (8, 9))


def test_min_tokens_beyond_max_tokens_and_empty_allowed_ids_are_refused():
    with pytest.raises(ApiError, match="min_tokens must be in"):
        settings(max_tokens=3, min_tokens=4)
    with pytest.raises(ApiError, match="allowed_token_ids is not None and empty"):
        settings(allowed_token_ids=[])
    with pytest.raises(ApiError, match="out of the vocabulary"):
        settings(allowed_token_ids=[10])
    with pytest.raises(ApiError, match=r"presence_penalty must be in \[-2, 2\]"):
        settings(presence_penalty=3)


LOGITS = torch.tensor([0.5, -1.0, 2.0, 0.25, 1.5, -0.5, 0.0, 1.0, -2.0, 0.75])


def greedy(**fields) -> Params:
    return Params(8, temperature=0.0, eos_id=2, **fields)


def test_allowed_tokens_leave_the_log_softmax_over_them():
    scores = processed_logprobs(LOGITS, greedy(allowed=frozenset({1, 4, 9})), [0], [])
    kept = LOGITS[[1, 4, 9]].log_softmax(-1)
    assert torch.equal(scores[[1, 4, 9]], kept)
    assert all(math.isinf(v) for i, v in enumerate(scores.tolist()) if i not in (1, 4, 9))


def test_a_bad_words_last_token_is_barred_only_after_the_rest_of_it():
    p = greedy(bad_words=((4, 5), (7,)))
    assert math.isinf(processed_logprobs(LOGITS, p, [0, 4], [4])[5])  # after 4: 5 barred
    assert math.isfinite(processed_logprobs(LOGITS, p, [0, 3], [3])[5])  # after 3: free
    assert math.isinf(processed_logprobs(LOGITS, p, [0], [])[7])  # a one-token word: always


def test_min_tokens_bar_the_end_tokens_until_enough_are_out():
    p = greedy(min_tokens=2, stop_ids=frozenset({3}))
    early = processed_logprobs(LOGITS, p, [0, 1], [1])
    assert math.isinf(early[2]) and math.isinf(early[3])
    assert torch.equal(processed_logprobs(LOGITS, p, [0, 1, 1], [1, 1]),
                       LOGITS.log_softmax(-1))


def test_logit_bias_frequency_and_presence_penalties_move_the_logits_as_vllm_does():
    p = greedy(logit_bias=((0, 1.0), (9, -2.0)), frequency_penalty=0.5, presence_penalty=0.25)
    output = [4, 4, 6]
    expected = LOGITS.clone()
    expected[0] += 1.0
    expected[9] += -2.0
    expected[4] -= 2 * 0.5 + 0.25
    expected[6] -= 0.5 + 0.25
    assert torch.allclose(processed_logprobs(LOGITS, p, [0, *output], output),
                          expected.log_softmax(-1), atol=0, rtol=1e-6)


def test_default_settings_take_the_shared_path_unchanged():
    """Rows without any of them are drawn together, through exactly the operations they were
    before (the GRPO pipeline's bits)."""
    plain = Params(8, temperature=0.7, top_k=5)
    assert not plain.own_row
    assert torch.equal(processed_logprobs(LOGITS[None], plain),
                       (LOGITS[None] / 0.7).masked_fill(
                           LOGITS[None] < LOGITS.topk(5).values[-1], -math.inf).log_softmax(-1))


def test_a_chat_answer_with_tool_calls_carries_them_as_vllm_does(tiny_model):
    """With tools and tool_choice "auto", the calls the model wrote (the worker's parser)
    become the message's tool_calls, its content the text outside them."""
    import json

    from transformers import AutoTokenizer

    from reprorl.serve.api import Reply
    from reprorl.serve.chat import chat_completion
    from reprorl.serve.sequence import Sequence

    tokenizer = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    written = 'Checking.<tool_call>\n{"name": "lookup", "arguments": {"id": 7}}\n</tool_call>'
    seq = Sequence([1, 2], Params(64), None, torch.Generator())
    seq.generated = tokenizer(written, add_special_tokens=False)["input_ids"]
    seq.finish_reason = "length"
    reply = Reply("m", False, True, True, "r1", 1, False)
    answer = chat_completion([seq], reply, tokenizer, str, tool_calls=True)
    (choice,) = answer["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "lookup"
    assert json.loads(call["function"]["arguments"]) == {"id": 7}
    plain = chat_completion([seq], reply, tokenizer, str, tool_calls=False)["choices"][0]
    assert plain["message"]["content"] == tokenizer.decode(seq.generated)
    assert "tool_calls" not in plain["message"] and plain["finish_reason"] == "length"
