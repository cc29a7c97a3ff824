"""`reprorl serve`: the embedded generation server, speaking the part of vLLM's API GRPO uses.

It loads a Hugging Face directory, runs the batch-invariant engine in a background thread
(`engine_thread.py`) and serves vLLM's routes over aiohttp: `/health`, `/v1/models`,
`/metrics`, `/v1/completions`, `/inference/v1/generate` (`--enable-scale-out`), LoRA loading
and, as vLLM's development mode does, `/collective_rpc` (`reload_weights`) and
`/reset_prefix_cache`. Request checks and response shapes are in `api.py`, what it loads in
`weights.py`; docs/server.md lists what it honours and where it departs from vLLM.
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
from functools import lru_cache
from pathlib import Path

import torch
from aiohttp import web

from reprorl.core import devices, numerics
from reprorl.core.errors import ReproError
from reprorl.core.manifest import atomic_write_text

from .adapters import Adapter
from .api import (
    Reply,
    completion,
    error_body,
    generation,
    metrics,
    number,
    refuse_constant,
    sampling_params,
    text,
)
from .engine_thread import EngineThread
from .invariance import SPAN_ROWS
from .logprobs import Params
from .sequence import ApiError, Sequence
from .weights import copy_weights, install_switches, read_adapter, read_weights, weight_targets

log = logging.getLogger("reprorl.serve")


WEIGHT_ROUTES = ("/collective_rpc", "/reset_prefix_cache")  # a Bearer key too, when one is set


def error_response(error: ApiError) -> web.Response:
    """vLLM's JSON error, with the error's status."""
    return web.json_response(error_body(error), status=error.status)


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
        self.engine = EngineThread(model, switches, args.max_num_seqs, args.kv_cache_tokens,
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
        page = metrics(self.engine, self.name, self.args.max_loras)
        return web.Response(body=page.encode(), headers={
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

    async def load_lora(self, request):
        body = await self.body(request)
        name, path = text(body, "lora_name"), text(body, "lora_path")
        if not name or not path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.adapters or name == self.name:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded.")
        if len(self.adapters) >= self.args.max_loras:
            raise ApiError(400, f"{self.args.max_loras} LoRA adapters are already loaded "
                           "(--max-loras); unload one first.")
        adapter = await asyncio.to_thread(read_adapter, name, path, self.engine.adapters.switches,
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
        name = text(await self.body(request), "lora_name")
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
        path = text(kwargs, "weights_path") or self.args.model
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
        return sampling_params(body, prompt_len, self.max_len, self.args.max_logprobs,
                               self.eos_id, self.extra_eos)

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
        model = text(body, "model") or self.name
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
        return web.json_response(await self.in_text_pool(
            lambda: completion(seq, reply, self.tokenizer, self.piece)))

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
        return web.json_response(generation(seq, request_id))


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
    # read by `reprorl serve` before torch loads (reprorl.core.numerics); a child of a stage
    # inherits its stage's mode instead
    add("--numerics", choices=numerics.MODES, default=None,
        help="portable: AVX2 kernels pinned, the same bits on any x86-64 CPU with AVX2")
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
        if args.numerics not in (None, numerics.mode()):  # torch is loaded: too late to pin
            raise ReproError(f"--numerics {args.numerics} is pinned before torch loads: start "
                             f"the server as `reprorl serve --numerics {args.numerics}`")
        numerics.check()  # a stage's portable pins, inherited: refused if torch ignored them
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
