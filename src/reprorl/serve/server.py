"""An embedded CPU generation server speaking the part of vLLM's OpenAI API that GRPO uses.

`reprorl serve --model DIR` loads a Hugging Face directory and serves `/health`, `/v1/models`,
`/metrics`, `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`, `/v1/completions` and (with
`--enable-scale-out`) the token-in/token-out `/inference/v1/generate`, whose `sampling_mask`
(`--return-sampling-mask`) gives each sampled token's candidate set, with
vLLM's request and response shapes, so a client written against it runs unchanged against a real
`vllm serve`; and, as vLLM does with `VLLM_SERVER_DEV_MODE=1`, `/collective_rpc` (its
`reload_weights` method only: new full weights from a directory, applied between two engine
steps) and `/reset_prefix_cache`, through which full-model training syncs merged weights.
A background thread runs the batch-invariant engine (`reprorl.serve.engine.Engine`) over
`min(--max-num-seqs, --kv-cache-tokens // --max-model-len)` preallocated KV slots in whole
groups of `--decode-rows` (with one thread and 16 rows or more, one forward spans every group in
use): a request's tokens, log-probs and top log-probs are bitwise the same whatever else runs
beside it. Before it listens, the engine settles what it probes once per process
(`Engine.warm_up`), as vLLM profiles its model at start-up. Log-probs are vLLM's
`processed_logprobs` (after the repetition penalty, temperature, min-p, top-k, top-p; greedy:
the penalised log-softmax). Each request samples with its own generator.

Departures from vLLM: CPU only, one process; no streaming, `n` = 1, no `echo`, one prompt per
request, no stop strings, no `min_tokens`, no presence or frequency penalty (0 only), no beam
search, no chat endpoint, no defaults from the model's generation_config.json; the KV cache is
a slot of `--max-model-len` tokens per sequence, not paged blocks (the metrics report
`slots * max-model-len // 16` blocks); no preemption (a request waits for a free slot), and
`--max-model-len` may not exceed `--kv-cache-tokens`;
loading more than `--max-loras` adapters is refused instead of LRU-swapped, and LoRA model
cards carry `max_model_len` too; `reload_weights` checks every tensor against the model (names,
shapes, finite values, every weight given) and answers a wrong directory with 400 or 404, where
vLLM answers 500; a request with `seed: null` draws its seed from the server's
`--seed` stream; seeded tokens may differ from vLLM's (its kernels give other log-prob bits;
the draw itself, `logprobs.race`, is the exponential race vLLM runs).

Hardening (vLLM's behaviour where it has one): `--api-key` / `VLLM_API_KEY` requires a Bearer
token on `/v1/*` (401 `{"error": "Unauthorized"}`, as vLLM). Additions of ours: `--lora-root`
confines adapter paths to one directory (regular files only); `/metrics` also says where the
engine thread's time goes (`reprorl:engine_*`); every number must be finite and
in range; every error is vLLM's JSON error shape with its status (400 bad input, 404, 405, 413
`--max-request-bytes`, 503 overloaded (`--max-waiting-requests`) or engine down, 500 only for
a fault); an adapter with non-finite weights is refused; an exception while prefilling,
decoding or sampling one sequence fails that request only; a client that disconnects aborts
its generation; string prompts are tokenised off the event loop. What it loads (adapters, full
weights) is read and checked by `server_weights.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import logging
import os
import random
import secrets
import signal
import socket
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from aiohttp import web

from reprorl.core import devices
from reprorl.core.errors import ReproError
from reprorl.core.manifest import atomic_write_text

from .engine import WORK, Adapter, ApiError, Engine, Sequence
from .invariance import SPAN_ROWS
from .logprobs import Params
from .weights import (
    copy_weights,
    install_switches,
    number,
    read_adapter,
    read_weights,
    refuse_constant,
    weight_targets,
)

log = logging.getLogger("reprorl.serve")


SYSTEM_FINGERPRINT = "reprorl-serve"
WEIGHT_ROUTES = ("/collective_rpc", "/reset_prefix_cache")  # a Bearer key too, when one is set
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError",
               413: "RequestEntityTooLargeError", 503: "ServiceUnavailableError"}


def error_response(error: ApiError) -> web.Response:
    """vLLM's JSON error body, with the error's status."""
    kind = ERROR_TYPES.get(error.status, "InternalServerError")
    return web.json_response({"error": {"message": error.message, "type": kind,
                                        "param": error.param, "code": error.status}},
                             status=error.status)


# ---------------------------------------------------------------- HTTP


def json_logprob(value: float) -> float:
    """A log-prob as vLLM writes it: -inf (a token truncation removed) as -9999.0, which JSON
    can hold."""
    return max(value, -9999.0)


@dataclass(frozen=True)
class Reply:
    """What a completion's response needs from its request body (the body is not kept)."""

    model: str
    as_ids: bool  # return_tokens_as_token_ids
    with_ids: bool  # return_token_ids
    skip_special: bool  # skip_special_tokens

    @classmethod
    def of(cls, body: dict, model: str) -> Reply:
        return cls(model, bool(body.get("return_tokens_as_token_ids")),
                   bool(body.get("return_token_ids")),
                   body.get("skip_special_tokens", True) is not False)


class Server:
    def __init__(self, args, model, tokenizer):
        self.args, self.tokenizer = args, tokenizer
        self.name = args.served_model_name or args.model
        self.max_len = served_length(args, model)
        self.adapters: dict[str, Adapter] = {}
        self.rng = random.Random(args.seed)
        self.created = int(time.time())
        generation = getattr(model, "generation_config", None)
        extra = getattr(generation, "eos_token_id", None)
        self.eos_id = tokenizer.eos_token_id
        self.extra_eos = {extra} if isinstance(extra, int) else set(extra or ())
        self.extra_eos.discard(self.eos_id)
        self.vocab = model.config.vocab_size
        # by checkpoint name, before the Switches rename the linears
        self.weights = weight_targets(model)
        switches = install_switches(model)
        self.engine = Engine(model, switches, args.max_num_seqs, args.kv_cache_tokens,
                             self.max_len, args.decode_rows)
        self.piece = lru_cache(maxsize=1 << 16)(
            lambda tid: tokenizer.decode([tid], skip_special_tokens=False))
        # every tokenizer call runs here: off the event loop, one at a time (a fast tokenizer
        # is not safe to call from several threads at once)
        self.text_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self.lora_root = Path(args.lora_root).resolve() if args.lora_root else None
        keys = [key for key in (args.api_key or [os.environ.get("VLLM_API_KEY")]) if key]
        self.key_digests = [hashlib.sha256(key.encode()).digest() for key in keys]

    def authorised(self, request) -> bool:
        """vLLM's rule: with keys set, every /v1 request but OPTIONS needs one as a Bearer
        token (digests compared in constant time); ours also for the weight routes, which
        vLLM keeps behind its development mode."""
        if not self.key_digests or request.method == "OPTIONS" or not (
                request.path.startswith("/v1") or request.path in WEIGHT_ROUTES):
            return True
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        digest = hashlib.sha256(token.encode()).digest()
        return scheme.lower() == "bearer" and any(
            secrets.compare_digest(digest, known) for known in self.key_digests)

    def app(self):

        @web.middleware
        async def errors(request, handler):
            if not self.authorised(request):
                return web.json_response({"error": "Unauthorized"}, status=401)
            try:
                return await handler(request)
            except ApiError as error:
                return error_response(error)
            except web.HTTPException as error:  # aiohttp's own: no route, method, body size
                if error.status < 400:
                    raise
                message = error.reason
                if error.status == 413:
                    message = (f"The request body is larger than --max-request-bytes "
                               f"({self.args.max_request_bytes}).")
                return error_response(ApiError(error.status, message))
            except Exception as error:  # a fault of ours: still JSON, still one request
                log.exception("request failed")
                return error_response(ApiError(500, f"{type(error).__name__}: {error}"))

        app = web.Application(middlewares=[errors], client_max_size=self.args.max_request_bytes)
        app.add_routes([
            web.get("/health", self.health),
            web.get("/v1/models", self.models),
            web.get("/metrics", self.metrics),
            web.post("/v1/load_lora_adapter", self.load_lora),
            web.post("/v1/unload_lora_adapter", self.unload_lora),
            web.post("/v1/completions", self.completions),
            web.post("/inference/v1/generate", self.generate),
            web.post("/collective_rpc", self.collective_rpc),
            web.post("/reset_prefix_cache", self.reset_prefix_cache),
        ])
        return app

    async def health(self, request):
        if not self.engine.is_alive():
            raise ApiError(503, "The engine thread is not running.")
        return web.Response(status=200)

    def card(self, name: str, root: str, parent: str | None) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "reprorl",
                "root": root, "parent": parent, "max_model_len": self.max_len,
                "permission": [{  # vLLM's card carries OpenAI's permission object too
                    "id": f"modelperm-{name}", "object": "model_permission",
                    "created": self.created, "allow_create_engine": False,
                    "allow_sampling": True, "allow_logprobs": True,
                    "allow_search_indices": False, "allow_view": True,
                    "allow_fine_tuning": False, "organization": "*", "group": None,
                    "is_blocking": False}]}

    async def models(self, request):
        cards = [self.card(self.name, self.args.model, None)] + [
            self.card(a.name, a.path, self.name) for a in self.adapters.values()]
        return web.json_response({"object": "list", "data": cards})

    async def metrics(self, request):
        engine, label = self.engine, f'engine="0",model_name="{self.name}"'
        counters, blocks = engine.counters, f'num_gpu_blocks="{engine.capacity // 16}",'
        table = [  # name, type, help, [(extra labels, value)]
            ("vllm:num_requests_running", "gauge", "Requests in model execution batches.",
             [("", len(engine.running))]),
            ("vllm:num_requests_waiting", "gauge", "Requests waiting to be processed.",
             [("", len(engine.waiting))]),
            ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
             [("", engine.kv_in_use() / engine.capacity)]),
            ("vllm:num_preemptions_total", "counter", "Cumulative number of preemptions.",
             [("", counters["preemptions"])]),
            ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
             [("", counters["prompt_tokens"])]),
            ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
             [("", counters["generation_tokens"])]),
            ("vllm:prefix_cache_queries_total", "counter",
             "Prefix cache queries, in terms of number of queried tokens.",
             [("", counters["prefix_cache_queries"])]),
            ("vllm:prefix_cache_hits_total", "counter",
             "Prefix cache hits, in terms of number of cached tokens.",
             [("", counters["prefix_cache_hits"])]),
            ("vllm:request_success_total", "counter", "Count of successfully processed requests.",
             [(f'finished_reason="{r}",', n) for r, n in engine.successes.items()]),
            ("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
             [(f'block_size="16",{blocks}', 1)]),
        ]
        table += [(f"reprorl:engine_{key}_total", "counter", text, [("", engine.work[key])])
                  for key, text in WORK.items()]
        lines = []
        for name, kind, text, samples in table:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{{{extra}{label}}} {float(value)}" for extra, value in samples]
        # vLLM's LoRA gauge: no engine label; the value is when it was set
        running = ",".join(sorted({seq.adapter.name for seq in list(engine.running)
                                   if seq.adapter is not None}))
        lines += ["# HELP vllm:lora_requests_info Running stats on lora requests.",
                  "# TYPE vllm:lora_requests_info gauge",
                  (f'vllm:lora_requests_info{{max_lora="{self.args.max_loras}",'
                   f'running_lora_adapters="{running}",waiting_lora_adapters=""}} {time.time()}')]
        return web.Response(body=("\n".join(lines) + "\n").encode(), headers={
            "Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def body(self, request) -> dict:
        raw = await request.read()  # over --max-request-bytes: aiohttp's 413
        try:
            if len(raw) > 1 << 16:  # a large body is parsed off the event loop
                body = await asyncio.to_thread(json.loads, raw, parse_constant=refuse_constant)
            else:
                body = json.loads(raw, parse_constant=refuse_constant)
        except (ValueError, RecursionError) as error:  # RecursionError: nesting too deep
            raise ApiError(400, f"Invalid JSON body: {error}") from error
        if not isinstance(body, dict):
            raise ApiError(400, "The request body must be a JSON object.")
        return body

    @staticmethod
    def text(body: dict, key: str) -> str | None:
        value = body.get(key)
        if value is not None and not isinstance(value, str):
            raise ApiError(400, f"'{key}' must be a string, got {type(value).__name__}.")
        return value

    async def load_lora(self, request):
        body = await self.body(request)
        name, path = self.text(body, "lora_name"), self.text(body, "lora_path")
        if not name or not path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.adapters or name == self.name:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded.")
        if len(self.adapters) >= self.args.max_loras:
            raise ApiError(400, f"{self.args.max_loras} LoRA adapters are already loaded "
                           "(--max-loras); unload one first.")
        adapter = await asyncio.to_thread(read_adapter, name, path, self.engine.switches,
                                          self.args.max_lora_rank, self.lora_root)
        if self.engine.unsettled(adapter.rank):  # once a rank, not at every weight sync
            # the engine's probe, ahead of the adapter's first decode step and in the engine
            # thread between steps: beside a weight reload it could read half-copied weights
            await asyncio.wrap_future(self.engine.between_steps(
                functools.partial(self.engine.settle_rank, adapter.rank)))
        if name in self.adapters:  # loaded by a concurrent request meanwhile
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded.")
        if len(self.adapters) >= self.args.max_loras:  # likewise
            raise ApiError(400, f"{self.args.max_loras} LoRA adapters are already loaded "
                           "(--max-loras); unload one first.")
        self.adapters[name] = adapter
        log.info("loaded LoRA adapter %s from %s", name, path)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request):
        name = self.text(await self.body(request), "lora_name")
        if self.adapters.pop(name, None) is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.")
        log.info("unloaded LoRA adapter %s", name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def collective_rpc(self, request):
        """vLLM's development endpoint, for its `reload_weights` method: the weights of
        `kwargs.weights_path` (default: --model) replace the served ones between two engine
        steps, and the prefix cache, computed with the old ones, is dropped."""
        body = await self.body(request)
        method, kwargs = body.get("method"), body.get("kwargs") or {}
        if method != "reload_weights":
            raise ApiError(400, f"collective_rpc method {method!r} is not supported here "
                           "(reload_weights only).")
        if not isinstance(kwargs, dict):
            raise ApiError(400, "'kwargs' must be an object.")
        path = self.text(kwargs, "weights_path") or self.args.model
        allowed = [] if self.lora_root is None else [self.lora_root,
                                                     Path(self.args.model).resolve()]
        try:
            tensors = await asyncio.to_thread(read_weights, path, self.weights, allowed)
        except ApiError as error:
            raise ApiError(error.status, f"reload_weights: {error.message}") from error

        def apply() -> None:
            copy_weights(self.weights, tensors)
            self.engine.reset_prefix_cache()

        await asyncio.wrap_future(self.engine.between_steps(apply))
        log.info("reloaded weights from %s", path)
        return web.json_response({"results": [None]})

    async def reset_prefix_cache(self, request):
        await asyncio.wrap_future(self.engine.between_steps(self.engine.reset_prefix_cache))
        return web.json_response({"success": True})

    def params(self, body: dict, prompt_len: int) -> Params:
        for key in ("stream", "echo"):
            if body.get(key):
                raise ApiError(400, f"'{key}' is not supported by this server.")
        if number(body, "n", 1, int) != 1:
            raise ApiError(400, "Only n=1 is supported by this server.")
        unbounded = "max_tokens" in body and body["max_tokens"] is None  # vLLM: fill the context
        maximum = number(body, "max_tokens", self.max_len - prompt_len if unbounded else 16, int)
        if maximum < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {maximum}.")
        if prompt_len + maximum > self.max_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_len} tokens. "
                           f"However, you requested {prompt_len + maximum} tokens ({prompt_len} "
                           f"in the messages, {maximum} in the completion). Please reduce the "
                           "length of the messages or completion.")
        p = Params(maximum, number(body, "temperature", 1.0), number(body, "top_p", 1.0),
                   number(body, "top_k", 0, int), number(body, "min_p", 0.0),
                   number(body, "repetition_penalty", 1.0))
        if p.temperature < 0 or not 0 < p.top_p <= 1 or p.top_k < -1 or not 0 <= p.min_p <= 1:
            raise ApiError(400, "temperature must be >= 0, top_p in (0, 1], top_k >= -1 and "
                           "min_p in [0, 1].")
        for key in ("presence_penalty", "frequency_penalty"):
            if number(body, key, 0.0) != 0:
                raise ApiError(400, f"'{key}' is not supported by this server.")
        if p.repetition_penalty <= 0:
            raise ApiError(400, "repetition_penalty must be greater than zero, got "
                           f"{p.repetition_penalty}.")
        if body.get("logprobs") is not None:
            p.logprobs = number(body, "logprobs", 0, int)
            if not 0 <= p.logprobs <= self.args.max_logprobs:
                raise ApiError(400, f"Requested sample logprobs of {p.logprobs}, which is "
                               f"greater than max allowed: {self.args.max_logprobs}")
        stops = body.get("stop_token_ids") or []
        if not isinstance(stops, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in stops):
            raise ApiError(400, "'stop_token_ids' must be a list of token ids.")
        ignore = bool(body.get("ignore_eos", False))
        p.eos_id = None if ignore else self.eos_id
        p.stop_ids = frozenset(stops) | (frozenset() if ignore else frozenset(self.extra_eos))
        return p

    async def prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            encode = functools.partial(self.tokenizer, prompt, add_special_tokens=False)
            prompt = (await self.in_text_pool(encode))["input_ids"]
        if not isinstance(prompt, list) or not prompt or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ApiError(400, "'prompt' must be a non-empty string or list of token ids "
                           "(one prompt per request).")
        if any(not 0 <= t < self.vocab for t in prompt):
            raise ApiError(400, f"Token id out of vocabulary (size {self.vocab}).")
        return prompt

    def refuse_if_overloaded(self) -> None:
        if len(self.engine.waiting) >= self.args.max_waiting_requests:
            raise ApiError(503, f"The server is overloaded: {len(self.engine.waiting)} requests "
                           "are waiting (--max-waiting-requests); retry later.")

    async def in_text_pool(self, work):
        return await asyncio.get_running_loop().run_in_executor(self.text_pool, work)

    def model_of(self, body: dict) -> str:
        """The request's model, checked, with the engine running and room in its queue."""
        model = self.text(body, "model") or self.name
        if model != self.name and model not in self.adapters:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model")
        if not self.engine.is_alive():
            raise ApiError(503, "The engine thread is not running.")
        self.refuse_if_overloaded()
        return model

    async def run(self, prompt: list[int], params: Params, model: str, seed) -> Sequence:
        """Generate to the end; a client that goes away aborts its sequence."""
        generator = devices.generator(
            self.rng.getrandbits(63) if seed is None else seed % (1 << 64), self.engine.device)
        self.refuse_if_overloaded()  # again: others may have queued while this one tokenised
        loop = asyncio.get_running_loop()
        seq = Sequence(prompt, params, self.adapters.get(model), generator,
                       loop.create_future(), loop)
        self.engine.submit(seq)
        try:
            await seq.future
        except asyncio.CancelledError:
            seq.aborted = True  # the client went away: the engine drops it at its next step
            raise
        return seq

    async def completions(self, request):
        body = await self.body(request)
        model = self.model_of(body)
        prompt = await self.prompt(body.get("prompt"))
        params = self.params(body, len(prompt))
        seed = number(body, "seed", None, int)
        reply = Reply.of(body, model)
        del body  # a waiting request keeps only what its reply needs
        seq = await self.run(prompt, params, model, seed)
        return web.json_response(await self.in_text_pool(lambda: self.response(seq, reply)))

    async def generate(self, request):
        """vLLM's `/inference/v1/generate` (`--enable-scale-out`): token ids in, token ids,
        `logprobs.content` and, with `--return-sampling-mask`, `sampling_mask` (per generated
        token, the ids it was drawn from) out."""
        if not self.args.enable_scale_out:
            raise ApiError(403, "Scale-out endpoints are disabled. Restart the server with "
                           "--enable-scale-out to enable them.")
        body = await self.body(request)
        model = self.model_of(body)
        prompt = await self.prompt(body.get("token_ids"))
        settings = body.get("sampling_params") or {}
        if not isinstance(settings, dict):
            raise ApiError(400, "'sampling_params' must be an object.")
        if len(prompt) < self.max_len and isinstance(settings.get("max_tokens"), int):
            # as the seed's vLLM: a turn stops at --max-model-len here; only a prompt that
            # fills it already is refused (by `params`)
            settings = {**settings, "max_tokens": min(settings["max_tokens"],
                                                      self.max_len - len(prompt))}
        params = self.params(settings, len(prompt))
        if self.args.return_sampling_mask:  # vLLM's per-request rule under the flag
            if params.temperature <= 0 or params.top_k <= 0:
                raise ApiError(400, "return_sampling_mask needs temperature > 0 and top_k > 0.")
            params.sampling_mask = True
        seed = number(settings, "seed", None, int)
        request_id = body.get("request_id") or f"gen-{uuid.uuid4().hex}"
        del body, settings
        seq = await self.run(prompt, params, model, seed)
        content = None
        if seq.params.logprobs is not None:
            content = [{"token_id": tid, "logprob": json_logprob(value), "rank": rank,
                        "top_logprobs": [{"token_id": other, "logprob": json_logprob(v)}
                                         for other, v in zip(ids, values)]}
                       for tid, (value, ids, values), rank in zip(
                           seq.generated, seq.logprobs, seq.ranks)]
        choice = {"index": 0, "finish_reason": seq.finish_reason,
                  "token_ids": list(seq.generated), "routed_experts": None,
                  "sampling_mask": list(seq.masks) if seq.params.sampling_mask else None,
                  "logprobs": None if content is None else {"content": content}}
        used = {"prompt_tokens": len(seq.prompt), "completion_tokens": len(seq.generated),
                "total_tokens": seq.length}
        return web.json_response({"request_id": request_id, "output_mode": "tokens",
                                  "choices": [choice], "usage": used})

    def response(self, seq: Sequence, reply: Reply) -> dict:
        as_ids, model = reply.as_ids, reply.model

        def piece(tid: int) -> str:
            return f"token_id:{tid}" if as_ids else self.piece(tid)

        shown = seq.generated[:-1] if seq.finish_reason == "stop" else seq.generated
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
            for tid, (value, ids, values) in zip(seq.generated, seq.logprobs):
                top = {piece(tid): json_logprob(value)}  # the sampled token first, as vLLM
                for other, other_value in zip(ids, values):
                    top.setdefault(piece(other), json_logprob(other_value))
                tokens = logprobs["tokens"]
                logprobs["text_offset"].append(
                    logprobs["text_offset"][-1] + len(tokens[-1]) if tokens else 0)
                tokens.append(piece(tid))
                logprobs["token_logprobs"].append(json_logprob(value))
                logprobs["top_logprobs"].append(top)
        with_ids = reply.with_ids
        choice = {
            "index": 0,
            "text": self.tokenizer.decode(shown, skip_special_tokens=reply.skip_special),
            "logprobs": logprobs,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "token_ids": list(seq.generated) if with_ids else None,
            "prompt_logprobs": None,
            "prompt_token_ids": list(seq.prompt) if with_ids else None,
            "routed_experts": None,  # vLLM's, for mixture-of-experts models
        }
        prompt_tokens, completion_tokens = len(seq.prompt), len(seq.generated)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": model, "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens,
                          "prompt_tokens_details": None, "completion_tokens_details": None},
                # vLLM's other top-level keys, empty here as they are in vLLM without those
                # features (tests/recorded/vllm-responses.json)
                "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
                "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


# ---------------------------------------------------------------- entry point


def served_length(args, model) -> int:
    """`--max-model-len`, or the model's positions."""
    return args.max_model_len or model.config.max_position_embeddings


def count(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high]."""
    def parse(text: str) -> int:
        value = int(text)  # not a number: argparse names the flag and the value
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="reprorl serve", description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", required=True, help="Hugging Face model directory")
    add("--served-model-name", default=None, help="model name in the API (default: --model)")
    add("--host", default="127.0.0.1")
    add("--port", type=count(0, 65535), default=8000, help="0 picks a free port")
    add("--port-file", default=None, help="write the bound port here once listening")
    add("--api-key", nargs="+", default=None,
        help="require one of these Bearer keys on /v1/* (default: $VLLM_API_KEY, if set)")
    add("--lora-root", default=None,
        help="load adapters only from below this directory (default: anywhere)")
    add("--max-model-len", type=count(1), default=None, help="default: max_position_embeddings")
    add("--max-num-seqs", type=count(1), default=64, help="running sequences at most")
    add("--decode-rows", type=count(1), default=SPAN_ROWS,
        help="rows of a decode group: a forward decodes one group, a fixed shape, or with "
             f"one thread and {SPAN_ROWS} rows or more every group in use (batch invariance)")
    add("--max-waiting-requests", type=count(1), default=1024,
        help="queued requests at most; more are refused with 503")
    add("--max-request-bytes", type=count(1024), default=2 << 20,
        help="request body size at most; larger ones are refused with 413")
    add("--kv-cache-tokens", type=count(1), default=32768, help="KV-cache capacity in tokens")
    add("--max-loras", type=count(1), default=6)
    add("--max-lora-rank", type=count(1), default=16)
    add("--max-logprobs", type=count(0), default=20)
    add("--enable-scale-out", action="store_true",
        help="serve vLLM's token-in/token-out /inference/v1/generate")
    add("--return-sampling-mask", action="store_true",
        help="return each sampled token's candidate set (top-k/top-p/min-p) from generate")
    add("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="float32",
        help="auto: the checkpoint's dtype")
    add("--threads", type=count(1), default=1, help="torch threads")
    add("--device", default="cpu",
        help="auto, cpu, cuda or cuda:N (a BF16-capable GPU, deterministic algorithms on)")
    add("--trust-remote-code", action="store_true", help="allow the model's own code")
    add("--seed", type=int, default=0)
    return parser.parse_args(argv)


async def serve(server: Server, args) -> None:
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its
    # generation (aiohttp 3.9+ leaves handlers running by default)
    runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    await web.SockSite(runner, sock).start()
    port = sock.getsockname()[1]
    if args.port_file:  # whole or absent: the trainer polls it (ServerProcess)
        atomic_write_text(args.port_file, f"{port}\n")
    print(f"reprorl serve: ready on http://{args.host}:{port}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping")
    engine = server.engine
    engine.stop()
    await asyncio.to_thread(engine.join, 30)
    for seq in [*engine.running, *engine.waiting]:  # answer in-flight requests, then close
        seq.resolve(ApiError(503, "The server is shutting down."))
    await asyncio.sleep(0)
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if args.api_key is not None and not all(args.api_key):  # e.g. an unset shell variable
        print("reprorl serve: error: --api-key is empty: give a key, or leave the flag out",
              file=sys.stderr)
        return 2
    if args.lora_root and not Path(args.lora_root).is_dir():
        print(f"reprorl serve: error: --lora-root {args.lora_root} is not a directory",
              file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):  # while loading; the event loop takes over
        signal.signal(sig, lambda *_: sys.exit(0))
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    try:
        device = devices.prepare(args.device, "--device")
    except ReproError as error:
        print(f"reprorl serve: error: {error}", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        args.model, local_files_only=True,
        dtype=args.dtype if args.dtype == "auto" else getattr(torch, args.dtype),
        trust_remote_code=args.trust_remote_code,
        attn_implementation="sdpa").to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True,
                                              trust_remote_code=args.trust_remote_code)
    max_len = served_length(args, model)
    if max_len > args.kv_cache_tokens:
        print(f"reprorl serve: error: --max-model-len {max_len} exceeds --kv-cache-tokens "
              f"{args.kv_cache_tokens}", file=sys.stderr)
        return 2
    if getattr(model.config, "use_sliding_window", False) or "sliding_attention" in (
            getattr(model.config, "layer_types", None) or ()):
        print("reprorl serve: error: sliding-window attention is not supported (the decode "
              "step's mask is per row, not per window)", file=sys.stderr)
        return 2
    server = Server(args, model, tokenizer)
    log.info("warmed up in %.2f s (the engine's probes)", server.engine.warm_up())
    server.engine.start()
    asyncio.run(serve(server, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
