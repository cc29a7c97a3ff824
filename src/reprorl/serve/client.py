"""Clients of a vLLM-compatible generation server (a real `vllm serve` or `reprorl serve`).

Only documented parts of vLLM's OpenAI server are used: `/v1/completions` with a token-id
prompt, `return_token_ids`, `return_tokens_as_token_ids` and `logprobs=k` (processed
log-probs when the server runs `--logprobs-mode processed_logprobs`), `/health`, `/v1/models`
(`max_model_len`), `/metrics`, `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`; with
top-k/top-p/min-p, `/inference/v1/generate` (`--enable-scale-out`), whose `sampling_mask`
(`--return-sampling-mask`) holds each sampled token's candidate set.

`CompletionClient` (asyncio, aiohttp) runs in the rollout worker; a failed request (connection
error, timeout, HTTP 5xx, which includes a server's 503 "overloaded") is retried `max_retries`
times with backoff, then raises an error naming the server. An HTTP 4xx is the request's fault
and raises at once with the server's message. `ServerAdmin` (blocking, requests) is the
trainer's: readiness and adapters. Both send `api_key` as a Bearer token when one is given (a
server started with `--api-key` answers 401 otherwise); `timeout` bounds each request.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import requests


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str  # "stop" or "length"
    sampling_mask: list[list[int]] | None = None  # per token, its candidate set


def parse_generate(body: dict) -> Completion:
    """`/inference/v1/generate`'s answer: token ids, `logprobs.content` and `sampling_mask`."""
    choice = body["choices"][0]
    ids = list(choice["token_ids"])
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(ids):
        raise ValueError(f"{len(ids)} tokens but {len(content)} log-probs: request logprobs")
    mask = choice.get("sampling_mask")
    if mask is not None and len(mask) != len(ids):
        raise ValueError(f"{len(ids)} tokens but {len(mask)} candidate sets")
    tops = [{int(t["token_id"]): float(t["logprob"]) for t in item.get("top_logprobs") or []}
            for item in content]
    reason = "stop" if choice.get("finish_reason") == "stop" else "length"
    return Completion(ids, [float(item["logprob"]) for item in content], tops, reason,
                      None if mask is None else [list(m) for m in mask])


def _token_id(key: str) -> int:
    if not key.startswith("token_id:"):
        raise ValueError(f"expected 'token_id:<n>' keys (return_tokens_as_token_ids), got {key!r}")
    return int(key[len("token_id:"):])


def parse_completion(body: dict) -> Completion:
    choice = body["choices"][0]
    ids = choice.get("token_ids")
    if ids is None:
        raise ValueError("the server returned no token_ids: it must support return_token_ids "
                         "(vLLM >= 0.10.2)")
    logprobs = choice.get("logprobs") or {}
    sampled = logprobs.get("token_logprobs") or []
    if len(sampled) != len(ids):
        raise ValueError(f"{len(ids)} tokens but {len(sampled)} log-probs: request logprobs")
    tops = [{_token_id(k): float(v) for k, v in (top or {}).items()}
            for top in (logprobs.get("top_logprobs") or [None] * len(ids))]
    reason = "stop" if choice.get("finish_reason") == "stop" else "length"
    return Completion(list(ids), [float(x) for x in sampled], tops, reason)


# Every sampling setting the loss knows, sent with every request. A real vLLM fills the ones a
# request leaves out from the model's generation_config.json (`--generation-config auto`, its
# default: Qwen2.5-Instruct's asks for top_k 20, top_p 0.8 and a repetition penalty), so a
# setting left out would sample from a distribution the trainer does not score.
NEUTRAL_SAMPLING = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
                    "presence_penalty": 0.0, "frequency_penalty": 0.0}


def request_body(model: str, prompt_ids: list[int], settings: dict, generate: bool) -> dict:
    """A sampling request: `/inference/v1/generate`'s body (`generate`) or `/v1/completions`'s,
    with `settings` (max_tokens, temperature, seed, logprobs, ...) over NEUTRAL_SAMPLING."""
    settings = {**NEUTRAL_SAMPLING, "n": 1, "skip_special_tokens": False, **settings}
    if generate:
        return {"model": model, "token_ids": prompt_ids, "sampling_params": settings}
    return {"model": model, "prompt": prompt_ids, "return_token_ids": True,
            "return_tokens_as_token_ids": True, "stream": False, **settings}
_SAMPLE = re.compile(r"^(vllm:[a-zA-Z_]+)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)\s*$")


def parse_prometheus(text: str) -> dict:
    """The vLLM gauges/counters the worker reads, summed over engines; cache capacity, the
    engine cores (`engines`: data-parallel replicas) and `max_loras` too."""
    out: dict = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if not match:
            continue
        name, value = match.group(1)[5:], float(match.group(3))
        fields = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if "engine" in fields:
            out.setdefault("engines", set()).add(fields["engine"])
        if name == "cache_config_info":
            if fields.get("num_gpu_blocks", "") not in ("", "None"):
                out[name] = {"num_gpu_blocks": int(fields["num_gpu_blocks"]),
                             "block_size": int(fields.get("block_size", 16))}
        elif name == "lora_requests_info":  # vLLM's --max-loras, when LoRA is on
            if fields.get("max_lora", "").isdigit():
                out["max_loras"] = int(fields["max_lora"])
        elif name in ("kv_cache_usage_perc", "gpu_cache_usage_perc"):  # max over engines
            out["kv_cache_usage_perc"] = max(out.get("kv_cache_usage_perc", 0.0), value)
        elif name in ("num_requests_running", "num_requests_waiting", "num_preemptions_total"):
            out[name] = out.get(name, 0.0) + value
    return out


def auth_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def unauthorised(base_url: str, api_key: str | None) -> str:
    given = "the key given was refused" if api_key else "no key was given"
    return (f"the generation server at {base_url} requires an API key (HTTP 401) and {given}: "
            "set vllm_server_api_key (or VLLM_API_KEY) to its --api-key")


class CompletionClient:
    def __init__(self, base_url: str, timeout: float, max_retries: int,
                 api_key: str | None = None):
        self.base_url, self.timeout, self.max_retries = base_url.rstrip("/"), timeout, max_retries
        self.api_key = api_key
        self.session = None
        self._max_model_len = None

    async def open(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            connector=aiohttp.TCPConnector(limit=0), headers=auth_headers(self.api_key))

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def complete(self, model: str, prompt_ids: list[int], max_tokens: int,
                       temperature: float, seed: int, logprobs: int,
                       sampling: dict | None = None, sampling_mask: bool = False
                       ) -> tuple[Completion, int]:
        """One sampling request; `sampling` (top_k, top_p, min_p, repetition_penalty) is sent
        as is, and `sampling_mask` asks `/inference/v1/generate` for the candidate sets."""
        import aiohttp

        path, parse = (("/inference/v1/generate", parse_generate) if sampling_mask
                       else ("/v1/completions", parse_completion))
        body = request_body(model, prompt_ids, {
            "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
            "logprobs": logprobs, **(sampling or {})}, generate=sampling_mask)
        retries, last = 0, None
        while True:
            try:
                async with self.session.post(f"{self.base_url}{path}", json=body) as response:
                    text = await response.text()
                    if response.status == 401:
                        raise ServerRequestError(unauthorised(self.base_url, self.api_key), 401)
                    if response.status < 500:
                        if response.status != 200:
                            raise ServerRequestError(
                                f"the generation server refused a request (HTTP "
                                f"{response.status}): {text[:500]}", response.status)
                        return parse(json.loads(text)), retries
                    last = f"HTTP {response.status}: {text[:200]}"
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
                last = f"{type(error).__name__}: {error}"
            if retries >= self.max_retries:
                raise ServerDownError(
                    f"the generation server at {self.base_url} failed {retries + 1} times "
                    f"(last: {last}); check that it is running (vllm serve / reprorl serve) "
                    "or raise vllm_max_retries")
            retries += 1
            await asyncio.sleep(min(8.0, 0.25 * 2**retries))

    async def metrics(self) -> dict | None:
        import aiohttp

        try:
            async with self.session.get(f"{self.base_url}/metrics") as response:
                if response.status != 200:
                    return None
                return parse_prometheus(await response.text())
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
            # metrics are advisory: without them the concurrency cap stays where it is
            return None

    async def max_model_len(self) -> int:
        if self._max_model_len is None:
            async with self.session.get(f"{self.base_url}/v1/models") as response:
                if response.status == 401:
                    raise ServerRequestError(unauthorised(self.base_url, self.api_key), 401)
                self._max_model_len = int((await response.json())["data"][0]["max_model_len"])
        return self._max_model_len


def server_message(text: str) -> str:
    """The message of vLLM's error body ({"error": {"message": ...}}), else the raw text."""
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:300]


def load_failure(base_url: str, name: str, path: str, status: int, text: str) -> str:
    """What went wrong loading an adapter, and the fix, from the answers vLLM and the embedded
    server give (recorded in tests/recorded/vllm-responses.json)."""
    message = server_message(text)
    if status == 404 and "No adapter found" in message:  # vLLM: the path is not readable
        return (f"the server at {base_url} found no adapter at {path} ({name}): it must read "
                "the trainer's files at the same path (same machine, or output_dir on a "
                "filesystem both see)")
    if status == 404:  # no such route: LoRA updating is off
        return (f"{base_url} has no /v1/load_lora_adapter: start vLLM with --enable-lora and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
    if re.search(r"rank \d+ is greater than max_lora_rank", message):
        return (f"the server at {base_url} refused adapter {name}: {message} Restart it with "
                "a --max-lora-rank at least the policy's lora_rank")
    if "already been loaded" in message:
        return (f"the server at {base_url} already holds an adapter named {name}: {message}")
    if "--max-loras" in message:  # the embedded server refuses instead of evicting
        return (f"the server at {base_url} holds its --max-loras adapters already: {message} "
                "Restart it with --max-loras at least max_staleness + 2, or unload another "
                "run's adapters")
    return f"loading adapter {name} from {path} failed: HTTP {status} {message}"


def missing_route(response) -> bool:
    """A 404 or 405 about the route itself (FastAPI's `{"detail": ...}`, aiohttp's reason),
    not an answer of the endpoint."""
    if response.status_code not in (404, 405):
        return False
    message = server_message(response.text)
    return message in ("Not Found", "Method Not Allowed") or message.startswith('{"detail"')


class ServerRequestError(RuntimeError):
    """The server answered 4xx: the request is wrong, retrying cannot help."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class ServerDownError(RuntimeError):
    """The server kept failing after the allowed retries."""


class ServerAdmin:
    """The trainer's blocking calls: readiness, model length, adapters, metrics."""

    def __init__(self, base_url: str, timeout: float, api_key: str | None = None):
        self.base_url, self.timeout = base_url.rstrip("/"), timeout  # timeout: per request
        self.session = requests.Session()
        self.session.headers.update(auth_headers(api_key))
        self.api_key = api_key

    def request(self, method: str, path: str, **kwargs) -> requests.Response:
        timeout = kwargs.pop("timeout", self.timeout)
        try:
            response = self.session.request(method, f"{self.base_url}{path}", timeout=timeout,
                                            **kwargs)
        except requests.Timeout as error:
            raise TimeoutError(f"the generation server at {self.base_url} did not answer "
                               f"{method} {path} within {timeout:g} s (vllm_request_timeout)"
                               ) from error
        if response.status_code == 401:
            raise RuntimeError(unauthorised(self.base_url, self.api_key))
        return response

    def wait_ready(self, startup_timeout: float, process=None, log_path=None) -> None:
        started = time.monotonic()
        while True:
            try:
                if requests.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if process is not None and process.poll() is not None:
                tail = Path(log_path).read_text()[-2000:] if log_path else ""
                raise RuntimeError(f"the generation server exited with code "
                                   f"{process.returncode} before it was ready:\n{tail}")
            if time.monotonic() - started > startup_timeout:
                raise TimeoutError(f"no generation server answered {self.base_url}/health "
                                   f"within {startup_timeout:.0f} s; start it or raise "
                                   "vllm_server_timeout")
            time.sleep(0.2)

    def max_model_len(self) -> int:
        response = self.request("GET", "/v1/models")
        response.raise_for_status()
        return int(response.json()["data"][0]["max_model_len"])

    def sampling_mask_missing(self, model: str, prompt_ids: list[int]) -> str | None:
        """Why the server cannot return candidate sets (None: it can): a one-token
        `/inference/v1/generate` with top_k, whose answer must carry `sampling_mask`."""
        response = self.request("POST", "/inference/v1/generate", json=request_body(
            model, prompt_ids, {"max_tokens": 1, "temperature": 1.0, "top_k": 1, "logprobs": 0},
            generate=True))
        if response.status_code in (403, 404, 405):
            return (f"it has no token-in/token-out endpoint (HTTP {response.status_code} on "
                    "/inference/v1/generate: start it with --enable-scale-out, vLLM >= 0.28)")
        if response.status_code != 200:
            return f"/inference/v1/generate answered HTTP {response.status_code}: " + (
                server_message(response.text))
        if response.json()["choices"][0].get("sampling_mask") is None:
            return ("it returns no sampling_mask (start it with --return-sampling-mask "
                    "--logprobs-mode processed_logprobs; vLLM's model runner V2, which its CPU "
                    "build lacks)")
        return None

    def load_lora_adapter(self, name: str, path: str) -> None:
        response = self.request("POST", "/v1/load_lora_adapter", json={
            "lora_name": name, "lora_path": path, "load_inplace": False})
        if response.status_code != 200:
            raise RuntimeError(load_failure(self.base_url, name, path, response.status_code,
                                            response.text))

    def unload_lora_adapter(self, name: str) -> None:
        response = self.request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})
        if response.status_code != 200:
            raise RuntimeError(f"unloading adapter {name} from {self.base_url} failed: HTTP "
                               f"{response.status_code} {response.text[:300]}")

    def reload_weights(self, path: str) -> None:
        """The server's weights replaced by the full weights saved in `path`, then its prefix
        cache dropped (computed with the old ones): vLLM's development endpoints, as full-model
        training syncs."""
        call = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        for route, body in (("/collective_rpc", call), ("/reset_prefix_cache", None)):
            response = self.request("POST", route, json=body)
            if missing_route(response):
                raise RuntimeError(
                    f"{self.base_url} has no {route}: full-model training (use_peft=False) "
                    "syncs merged weights through vLLM's development endpoints; start vLLM "
                    "with VLLM_SERVER_DEV_MODE=1, or train a LoRA adapter (use_peft=True)")
            if response.status_code != 200:
                raise RuntimeError(f"reloading weights from {path} on {self.base_url} failed: "
                                   f"HTTP {response.status_code} "
                                   f"{server_message(response.text)}")

    def complete(self, model: str, prompt_ids: list[int], max_tokens: int,
                 temperature: float, seed: int) -> Completion:
        """One sampling request, blocking (the trainer's canary); errors raise at once."""
        response = self.request("POST", "/v1/completions", json=request_body(
            model, prompt_ids, {"max_tokens": max_tokens, "temperature": temperature,
                                "seed": seed, "logprobs": 0}, generate=False))
        if response.status_code != 200:
            raise RuntimeError(f"the server at {self.base_url} refused a request for {model}: "
                               f"HTTP {response.status_code} {server_message(response.text)}")
        return parse_completion(response.json())

    def served_models(self) -> list[str]:
        response = self.request("GET", "/v1/models")
        response.raise_for_status()
        return [card["id"] for card in response.json()["data"]]

    def metrics(self) -> dict | None:
        try:
            response = self.request("GET", "/metrics", timeout=10)
        except (requests.RequestException, TimeoutError):
            return None
        return parse_prometheus(response.text) if response.status_code == 200 else None
