"""`reprorl serve`: the embedded generation server, speaking the part of vLLM's API GRPO uses.

It loads a Hugging Face directory, runs the batch-invariant engine in a background thread
(`engine_thread.py`) and serves vLLM's routes over aiohttp: `/health`, `/v1/models`,
`/metrics`, `/v1/completions`, `/inference/v1/generate` (`--enable-scale-out`), LoRA loading
and, as vLLM's development mode does, `/collective_rpc` (`reload_weights`) and
`/reset_prefix_cache`. Request checks and response shapes are in `api.py`, what it loads in
`weights.py`; docs/server.md lists what it honours and where it departs from vLLM.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import hashlib
import importlib.metadata
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
from reprorl.core.preempt import ignore_job_signals

from .adapters import Adapter
from .api import (
    Reply,
    boolean,
    completion,
    error_body,
    generation,
    metrics,
    number,
    prompts,
    refuse_constant,
    sampling_params,
    text,
    token_ids,
)
from .chat import chat_completion, chat_settings, render
from .engine_thread import EngineThread
from .fields import (
    CHAT,
    COMPLETION,
    DETOKENIZE,
    SAMPLING,
    TOKENIZE,
    TOKENIZE_CHAT,
    refuse_unhonoured,
)
from .flags import arguments
from .logprobs import Params
from .model_routes import ModelRoutes
from .sequence import ApiError, Sequence
from .streaming import Stream, StreamOptions, respond
from .weights import install_switches, weight_targets

log = logging.getLogger("reprorl.serve")


WEIGHT_ROUTES = ("/collective_rpc", "/reset_prefix_cache")  # a Bearer key too, when one is set


def error_response(error: ApiError) -> web.Response:
    """vLLM's JSON error, with the error's status."""
    return web.json_response(error_body(error), status=error.status)


class Server(ModelRoutes):
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
        # the engine thread's own, for stop strings (`Sequence.find_stop_string`)
        self.engine_tokenizer = copy.deepcopy(tokenizer)
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
        get = {"/health": self.health, "/v1/models": self.models, "/metrics": self.metrics,
               "/version": self.version}
        post = {"/v1/completions": self.completions, "/v1/chat/completions": self.chat,
                "/tokenize": self.tokenize, "/detokenize": self.detokenize,
                "/inference/v1/generate": self.generate,
                # what it serves: adapters and weights (model_routes.py)
                "/v1/load_lora_adapter": self.load_lora,
                "/v1/unload_lora_adapter": self.unload_lora,
                "/collective_rpc": self.collective_rpc,
                "/reset_prefix_cache": self.reset_prefix_cache}
        app.add_routes([*(web.get(path, handler) for path, handler in get.items()),
                        *(web.post(path, handler) for path, handler in post.items())])
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

    async def version(self, request):
        return web.json_response({"version": importlib.metadata.version("reprorl")})

    async def tokenize(self, request):
        """vLLM's `/tokenize`: a text prompt's ids, or a chat's (`messages`, rendered)."""
        body = await self.body(request)
        chat = "messages" in body
        refuse_unhonoured(body, TOKENIZE_CHAT if chat else TOKENIZE)
        self.model_of(body)
        if chat:
            ids, _ = await self.in_text_pool(functools.partial(render, body, self.tokenizer))
        elif isinstance(body.get("prompt"), str):
            add_special = boolean(body, "add_special_tokens", True)
            ids = await self.prompt(body["prompt"], add_special) if body["prompt"] else []
        else:
            raise ApiError(400, "'prompt' must be a string.", param="prompt")
        strs = (self.tokenizer.convert_ids_to_tokens(ids)
                if boolean(body, "return_token_strs", False) else None)
        return web.json_response({"count": len(ids), "max_model_len": self.max_len,
                                  "tokens": ids, "token_strs": strs})

    async def detokenize(self, request):
        body = await self.body(request)
        refuse_unhonoured(body, DETOKENIZE)
        self.model_of(body)
        ids = await self.prompt(body.get("tokens"))
        return web.json_response({"prompt": await self.in_text_pool(
            lambda: self.tokenizer.decode(ids))})

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

    async def params(self, body: dict, lengths: list[int]) -> list[Params]:
        """The request's sampling settings for prompts of these lengths (which bound
        max_tokens), in the text pool: its bad words are tokenized there, once."""
        @functools.cache
        def encode(text: str) -> tuple[int, ...]:
            return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

        return await self.in_text_pool(lambda: [sampling_params(
            body, length, self.max_len, self.args.max_logprobs, self.eos_id, self.extra_eos,
            self.vocab, encode) for length in lengths])

    async def prompt(self, prompt, add_special: bool = True) -> list[int]:
        """A prompt's token ids: given, or a text's (`add_special`: the tokenizer's special
        tokens too, vLLM's add_special_tokens)."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            encode = functools.partial(self.tokenizer, prompt, add_special_tokens=add_special)
            prompt = (await self.in_text_pool(encode))["input_ids"]
        if not prompt:
            raise ApiError(400, "'prompt' must be a non-empty string or list of token ids.",
                           param="prompt")
        return token_ids({"prompt": prompt}, "prompt", self.vocab)

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

    async def run(self, prompt: list[int], params: Params, model: str, seed,
                  skip_special: bool = True, on_token=None) -> Sequence:
        """Generate to the end; a client that goes away aborts its sequence. Stop strings are
        searched in the text decoded as the reply decodes it (`skip_special`); `on_token`, a
        stream's, is called after each token (`Sequence.on_token`)."""
        generator = devices.generator(
            self.rng.getrandbits(63) if seed is None else seed % (1 << 64), self.engine.device)
        self.refuse_if_overloaded()  # again: others may have queued while this one tokenised
        loop = asyncio.get_running_loop()
        seq = Sequence(prompt, params, self.adapters.get(model), generator,
                       loop.create_future(), loop, on_token=on_token)
        if params.stop:
            seq.text_of = functools.partial(self.engine_tokenizer.decode,
                                            skip_special_tokens=skip_special)
        self.engine.submit(seq)
        try:
            await seq.future
        except asyncio.CancelledError:
            seq.aborted = True  # the client went away: the engine drops it at its next step
            raise
        return seq

    async def completions(self, request):
        """vLLM's `/v1/completions`: each prompt of the request sampled `n` times, sample j
        seeded seed + j as vLLM seeds a request's samples (a prompt is prefilled once: the
        others hit the prefix cache)."""
        body = await self.body(request)
        refuse_unhonoured(body, COMPLETION)
        model = self.model_of(body)
        reply = Reply.of(body, model)
        sent = prompts(body.get("prompt"))
        texts = [prompt if isinstance(prompt, str) else None for prompt in sent]
        add_special = boolean(body, "add_special_tokens", True)
        ids = [await self.prompt(prompt, add_special) for prompt in sent]
        params = await self.params(body, [len(prompt) for prompt in ids])
        seed = number(body, "seed", None, int)
        options = StreamOptions.of(body)
        del body  # a waiting request keeps only what its reply needs
        if options is not None:
            stream = Stream(reply, options, self.tokenizer, self.piece, False, texts,
                            len(ids) * reply.samples)
            return await self.streamed(request, stream, ids, params, model, seed)
        seqs = await self.samples(ids, params, model, seed, reply)
        return web.json_response(await self.in_text_pool(
            lambda: completion(seqs, reply, self.tokenizer, self.piece, texts)))

    async def streamed(self, request, stream: Stream, ids: list[list[int]],
                       params: list[Params], model: str, seed) -> web.StreamResponse:
        """Each prompt's `n` samples as server-sent events (`streaming.respond`); sample j
        seeded seed + j, as unstreamed."""
        samples = stream.reply.samples
        runs = [functools.partial(self.run, prompt, settings, model,
                                  None if seed is None else seed + sample,
                                  stream.reply.skip_special)
                for prompt, settings in zip(ids, params) for sample in range(samples)]
        return await respond(request, stream, runs, self.in_text_pool)

    async def samples(self, ids: list[list[int]], params: list[Params], model: str, seed,
                      reply: Reply) -> list[Sequence]:
        """Each prompt's `reply.samples` sequences, in order; sample j seeded seed + j."""
        runs = [asyncio.ensure_future(self.run(
            prompt, settings, model, None if seed is None else seed + sample,
            reply.skip_special)) for prompt, settings in zip(ids, params)
            for sample in range(reply.samples)]
        try:
            return await asyncio.gather(*runs)
        finally:  # one failed or the client went away: the others stop too
            for run in runs:
                run.cancel()

    async def chat(self, request):
        """vLLM's `/v1/chat/completions` (`chat.py`): the messages rendered, `n` samples."""
        body = await self.body(request)
        refuse_unhonoured(body, CHAT)
        model = self.model_of(body)
        reply = Reply.of(body, model)
        rendered, tools = await self.in_text_pool(functools.partial(render, body, self.tokenizer))
        prompt = await self.prompt(rendered)
        (params,) = await self.params(chat_settings(body), [len(prompt)])
        seed = number(body, "seed", None, int)
        options = StreamOptions.of(body)
        del body
        if options is not None:
            if tools:
                raise ApiError(400, "'stream' with tools is not supported by this server: tool "
                               "calls are parsed from the whole answer; ask without stream.",
                               param="stream")
            stream = Stream(reply, options, self.tokenizer, self.piece, True, [None],
                            reply.samples)
            return await self.streamed(request, stream, [prompt], [params], model, seed)
        seqs = await self.samples([prompt], [params], model, seed, reply)
        return web.json_response(await self.in_text_pool(
            lambda: chat_completion(seqs, reply, self.tokenizer, self.piece, tools)))

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
        refuse_unhonoured(settings, SAMPLING)
        if len(prompt) < self.max_len and isinstance(settings.get("max_tokens"), int):
            # as the seed's vLLM: a turn stops at --max-model-len here; only a prompt that
            # fills it already is refused (by `params`)
            settings = {**settings, "max_tokens": min(settings["max_tokens"],
                                                      self.max_len - len(prompt))}
        (params,) = await self.params(settings, [len(prompt)])
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
    for sig in stop_signals(args):
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


def stop_signals(args) -> tuple[int, ...]:
    """What stops the server: SIGTERM and SIGINT, or SIGINT alone (`--ignore-job-signals`)."""
    return (signal.SIGINT,) if args.ignore_job_signals else (signal.SIGTERM, signal.SIGINT)


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
    if args.ignore_job_signals:  # before the stops below; its parent held them until now
        ignore_job_signals()
    for sig in stop_signals(args):  # while loading; the event loop takes over
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
