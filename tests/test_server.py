"""The embedded generation server over real HTTP: vLLM's shapes, log-probs against a direct
forward pass, per-request seeds under concurrency, LoRA adapters, errors and preemption."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

MAX_LEN = 128
TOL = 1e-4


@contextlib.contextmanager
def running_server(model_dir, tmp_path, *flags):
    port_file = tmp_path / "port"
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "reprorl", "serve", "--model", str(model_dir), "--port", "0",
         "--port-file", str(port_file), *flags],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError((tmp_path / "server.log").read_text())
            time.sleep(0.1)
        url = f"http://127.0.0.1:{int(port_file.read_text())}"
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        yield url, process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with running_server(tiny_model, tmp_path_factory.mktemp("server"), "--max-model-len",
                        str(MAX_LEN), "--max-loras", "2", "--max-lora-rank", "8") as (url, _):
        yield url


@pytest.fixture(scope="module")
def reference(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True,
                                                 dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)


def complete(url, **body):
    response = requests.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def direct_logprobs(model, prompt, tokens, temperature=1.0):
    """log_softmax(logits / T) at every prefix, from one plain full forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0]
    return (logits[len(prompt) - 1:-1].float() / temperature).log_softmax(-1)


def prompt_ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def metrics(url) -> dict[str, float]:
    """Sample name -> value, summed over label sets."""
    response = requests.get(f"{url}/metrics", timeout=10)
    assert response.headers["Content-Type"].startswith("text/plain")
    values: dict[str, float] = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            sample, value = line.rsplit(" ", 1)
            name = sample.split("{")[0]
            values[name] = values.get(name, 0.0) + float(value)
    return values


def test_models_and_metrics(server, tiny_model):
    cards = requests.get(f"{server}/v1/models", timeout=10).json()
    assert cards["object"] == "list"
    assert cards["data"][0]["id"] == str(tiny_model)
    assert cards["data"][0]["max_model_len"] == MAX_LEN
    assert cards["data"][0]["parent"] is None
    text = requests.get(f"{server}/metrics", timeout=10).text
    assert 'vllm:cache_config_info{block_size="16",num_gpu_blocks="2048"' in text
    assert "# TYPE vllm:num_preemptions_total counter" in text
    values = metrics(server)
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total"):
        assert name in values


def test_logprobs_match_direct_forward(server, reference, tiny_model):
    model, tokenizer = reference
    prompt = prompt_ids(tokenizer, "What is the capital of France?")
    choice = complete(server, model=str(tiny_model), prompt=prompt, max_tokens=12,
                      temperature=0.8, seed=7, logprobs=5, ignore_eos=True,
                      return_token_ids=True, return_tokens_as_token_ids=True)
    tokens = choice["token_ids"]
    assert len(tokens) == 12 and choice["finish_reason"] == "length"
    assert choice["prompt_token_ids"] == prompt and choice["stop_reason"] is None
    assert choice["text"] == tokenizer.decode(tokens, skip_special_tokens=True)
    expected = direct_logprobs(model, prompt, tokens, 0.8)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in tokens]
    offsets = [0]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets
    for step, (token, value, top) in enumerate(zip(tokens, logprobs["token_logprobs"],
                                                   logprobs["top_logprobs"])):
        assert abs(value - float(expected[step, token])) < TOL
        best = expected[step].topk(5)
        keys = {f"token_id:{t}" for t in best.indices.tolist()} | {f"token_id:{token}"}
        assert set(top) == keys
        for key, lp in top.items():
            assert abs(lp - float(expected[step, int(key.split(":")[1])])) < TOL


def test_top_k_logprobs_are_renormalised(server, reference):
    model, tokenizer = reference
    prompt = prompt_ids(tokenizer, "Tell me a story.")
    choice = complete(server, prompt=prompt, max_tokens=8, top_k=5, seed=3, logprobs=5,
                      ignore_eos=True, return_token_ids=True)
    scores = direct_logprobs(model, prompt, choice["token_ids"])
    for step, token in enumerate(choice["token_ids"]):
        kept = scores[step].topk(5)
        assert token in kept.indices.tolist()
        renormalised = kept.values.log_softmax(-1)[kept.indices.tolist().index(token)]
        assert abs(choice["logprobs"]["token_logprobs"][step] - float(renormalised)) < TOL
        assert len(choice["logprobs"]["top_logprobs"][step]) <= 5


def test_seed_gives_same_tokens_alone_and_concurrently(server, reference):
    _, tokenizer = reference
    target = {"prompt": prompt_ids(tokenizer, "Name three colours."), "max_tokens": 16,
              "seed": 11, "logprobs": 0, "ignore_eos": True, "return_token_ids": True}
    alone = complete(server, **target)
    again = complete(server, **target)
    assert again["token_ids"] == alone["token_ids"]
    others = [{"prompt": prompt_ids(tokenizer, "Hello " * (i + 1)), "max_tokens": 6 + 5 * i,
               "seed": 100 + i, "logprobs": 2, "ignore_eos": True} for i in range(5)]
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(complete, server, **body) for body in [*others[:2], target,
                                                                       *others[2:]]]
        together = futures[2].result()
        assert all(f.result()["finish_reason"] == "length" for f in futures)
    assert together["token_ids"] == alone["token_ids"]
    for a, b in zip(alone["logprobs"]["token_logprobs"], together["logprobs"]["token_logprobs"]):
        assert abs(a - b) < TOL


def test_greedy_and_stop_tokens(server, reference):
    model, tokenizer = reference
    prompt = prompt_ids(tokenizer, "Greedy please.")
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 1,
            "ignore_eos": True, "return_token_ids": True}
    first, second = complete(server, **body), complete(server, **body)
    assert first["token_ids"] == second["token_ids"]
    scores = direct_logprobs(model, prompt, first["token_ids"])
    assert first["token_ids"] == scores.argmax(-1).tolist()
    for step, value in enumerate(first["logprobs"]["token_logprobs"]):
        assert abs(value - float(scores[step].max())) < TOL
    stop = first["token_ids"][3]
    cut = first["token_ids"][:first["token_ids"].index(stop) + 1]
    stopped = complete(server, **body, stop_token_ids=[stop])
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop
    assert stopped["token_ids"] == cut  # the stop token is kept in the ids and log-probs
    assert len(stopped["logprobs"]["token_logprobs"]) == len(cut)
    assert stopped["text"] == tokenizer.decode(cut[:-1], skip_special_tokens=True)


def test_request_errors(server, tiny_model):
    url = f"{server}/v1/completions"
    response = requests.post(url, json={"model": str(tiny_model), "prompt": [5] * 120,
                                        "max_tokens": 10}, timeout=10)
    assert response.status_code == 400
    assert response.json() == {"error": {
        "message": f"This model's maximum context length is {MAX_LEN} tokens. However, you "
                   "requested 130 tokens (120 in the messages, 10 in the completion). Please "
                   "reduce the length of the messages or completion.",
        "type": "BadRequestError", "param": None, "code": 400}}
    response = requests.post(url, json={"model": "nope", "prompt": [5]}, timeout=10)
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "The model `nope` does not exist."
    assert response.json()["error"]["type"] == "NotFoundError"
    for bad in ({"logprobs": 21}, {"n": 2}, {"stream": True}, {"prompt": []},
                {"temperature": -1}):
        body = {"prompt": [5, 6], **bad}
        assert requests.post(url, json=body, timeout=10).status_code == 400, bad


def adapter_model(tiny_model, directory, rank, seed):
    """A copy of the base with a non-zero LoRA of `rank`, exported in PEFT's format."""
    from transformers import AutoModelForCausalLM

    from reprorl import lora

    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True,
                                                 dtype=torch.float32).eval()
    lora.inject(model, rank, 16, seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("lora_B"):
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    lora.export_peft(model, directory, str(tiny_model), rank, 16)
    return model


def test_lora_adapters(server, reference, tiny_model, tmp_path):
    base, tokenizer = reference
    adapted = adapter_model(tiny_model, tmp_path / "adapter", 8, seed=1)
    load = f"{server}/v1/load_lora_adapter"
    body = {"lora_name": "policy-1", "lora_path": str(tmp_path / "adapter"), "load_inplace": 1}
    response = requests.post(load, json=body, timeout=30)
    assert response.status_code == 200
    assert response.text == "Success: LoRA adapter 'policy-1' added successfully."
    cards = requests.get(f"{server}/v1/models", timeout=10).json()["data"]
    assert cards[1]["id"] == "policy-1" and cards[1]["parent"] == str(tiny_model)
    assert requests.post(load, json=body, timeout=30).status_code == 400  # already loaded

    prompt = prompt_ids(tokenizer, "Adapt me.")
    choice = complete(server, model="policy-1", prompt=prompt, max_tokens=10, seed=5,
                      logprobs=0, ignore_eos=True, return_token_ids=True)
    tokens, served = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    expected = direct_logprobs(adapted, prompt, tokens)
    base_scores = direct_logprobs(base, prompt, tokens)
    rows = range(len(tokens))
    assert max(abs(served[i] - float(expected[i, tokens[i]])) for i in rows) < TOL
    assert max(abs(served[i] - float(base_scores[i, tokens[i]])) for i in rows) > 1e-3

    adapter_model(tiny_model, tmp_path / "wide", 16, seed=2)  # rank 16 > --max-lora-rank 8
    for bad in ({"lora_name": "wide", "lora_path": str(tmp_path / "wide")},
                {"lora_name": "missing", "lora_path": str(tmp_path / "missing")}):
        response = requests.post(load, json=bad, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["code"] == 400

    second = {**body, "lora_name": "policy-2"}
    assert requests.post(load, json=second, timeout=30).status_code == 200
    third = {**body, "lora_name": "policy-3"}  # --max-loras 2
    assert requests.post(load, json=third, timeout=30).status_code == 400

    unload = f"{server}/v1/unload_lora_adapter"
    with ThreadPoolExecutor(1) as pool:  # unloading under a running request must not break it
        running = pool.submit(complete, server, model="policy-2", prompt=prompt, max_tokens=100,
                              ignore_eos=True)
        time.sleep(0.05)
        assert requests.post(unload, json={"lora_name": "policy-2"}, timeout=10).ok
        assert running.result()["finish_reason"] == "length"
    response = requests.post(unload, json={"lora_name": "policy-1"}, timeout=10)
    assert response.status_code == 200
    assert response.text == "Success: LoRA adapter 'policy-1' removed successfully."
    response = requests.post(f"{server}/v1/completions", timeout=10,
                             json={"model": "policy-1", "prompt": prompt})
    assert response.status_code == 404
    response = requests.post(unload, json={"lora_name": "policy-1"}, timeout=10)
    assert response.status_code == 404 and response.json()["error"]["type"] == "NotFoundError"


def test_preemption_recomputes_and_stops_cleanly(tiny_model, reference, tmp_path):
    """48 KV tokens hold one 8+24-token request but never two of them at full length, so six
    concurrent requests must queue and, once two run together, be preempted."""
    _, tokenizer = reference
    flags = ("--max-model-len", "32", "--kv-cache-tokens", "48", "--max-num-seqs", "8")
    bodies = [{"prompt": prompt_ids(tokenizer, f"Count to {i}, please")[:8], "max_tokens": 24,
               "seed": i, "logprobs": 0, "ignore_eos": True, "return_token_ids": True}
              for i in range(6)]
    assert all(len(body["prompt"]) == 8 for body in bodies)
    with running_server(tiny_model, tmp_path, *flags) as (url, process):
        alone = [complete(url, **body) for body in bodies]
        assert metrics(url)["vllm:num_preemptions_total"] == 0
        with ThreadPoolExecutor(6) as pool:
            together = list(pool.map(lambda body: complete(url, **body), bodies))
        for a, b in zip(alone, together):
            assert b["token_ids"] == a["token_ids"] and b["finish_reason"] == "length"
            for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]):
                assert abs(x - y) < TOL
        values = metrics(url)
        assert values["vllm:num_preemptions_total"] > 0
        assert values["vllm:num_requests_running"] == values["vllm:num_requests_waiting"] == 0
        assert values["vllm:kv_cache_usage_perc"] == 0
        assert values["vllm:request_success_total"] == 12
        assert values["vllm:generation_tokens_total"] == 12 * 24
        process.terminate()
        assert process.wait(timeout=15) == 0
