"""The server's routes that change what it serves: LoRA adapters and weights.

vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, its development
`/collective_rpc` (`reload_weights`) and `/reset_prefix_cache`, mixed into `server.Server`,
whose attributes they use (the adapters, the engine thread, the arguments). Each change lands
between two engine steps, so no step runs on half-copied weights.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from pathlib import Path

from aiohttp import web

from .api import text
from .sequence import ApiError
from .weights import copy_weights, read_adapter, read_weights

log = logging.getLogger("reprorl.serve")


class ModelRoutes:
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
