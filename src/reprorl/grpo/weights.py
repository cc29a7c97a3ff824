"""`AdapterVersions`: weight versions published to the generation server through its LoRA path.

Version N is a PEFT adapter written atomically under `<directory>/v<N>/` and loaded as
`served_name(name, N)`, where `name` is unique to the trainer's run (`policy-<tag>`): a
long-lived server (`vllm serve` shared by several runs) may still hold another run's versions,
and a name it already has is refused. The newest `keep` versions stay loaded (`max_staleness +
1`: every sample the trainer may still accept was sampled under one of them); older ones are
unloaded, and their files deleted one publish later, because vLLM reloads an adapter it evicted
from its cache lazily, from its path, for a request already queued (TRL keeps files one sync
longer for the same reason). `close()` unloads what the run left loaded. After each load,
`check(name)` (when given) asks the server to prove it serves the new weights (the trainer's
canary: `SyncCheck` below).

Departure from the seed (TRL): no merged full-weight sync, so the server is never paused and no
other process is waited on; of the seed's pause/barrier/transfer split only the transfer (write
+ load) exists.
"""

from __future__ import annotations

import collections
import shutil
import time
from pathlib import Path


def served_name(name: str, version: int) -> str:
    """The model name a request uses to sample under `version` (the worker's and ours)."""
    return f"{name}-v{version}"


class AdapterVersions:
    def __init__(self, admin, directory: Path, name: str, keep: int, version, export,
                 check=None):
        self.admin = admin  # load_lora_adapter(name, path), unload_lora_adapter(name)
        self.directory, self.name, self.keep = Path(directory), name, keep
        self.version = version  # shared .value: the newest published version (read by the worker)
        self.export = export  # export(directory): writes the policy's adapter there
        self.check = check  # check(served name): raises unless the server serves the weights
        self.live: collections.deque[int] = collections.deque()
        self.retired: list[int] = []  # unloaded at the last publish: files kept until the next

    def adapter_name(self, version: int) -> str:
        return served_name(self.name, version)

    def publish(self, version: int, source: Path | None = None) -> tuple[float, float]:
        """Make `version` the served policy (the policy's weights now, or the adapter stored
        at `source`); returns (transfer seconds, total seconds)."""
        started = time.monotonic()
        for old in self.retired:  # a whole sync since their unload: no request can need them
            shutil.rmtree(self.directory / f"v{old}", ignore_errors=True)
        self.retired = []
        directory = self.directory / f"v{version}"
        shutil.rmtree(directory, ignore_errors=True)
        if source is None:
            self.export(directory)
        else:
            shutil.copytree(source, directory)
        self.admin.load_lora_adapter(self.adapter_name(version), str(directory.resolve()))
        self.live.append(version)  # loaded: close() must unload it, even if the check fails
        transfer_s = time.monotonic() - started
        if self.check is not None:
            self.check(self.adapter_name(version))
        self.version.value = version
        while len(self.live) > self.keep:
            old = self.live.popleft()
            self.admin.unload_lora_adapter(self.adapter_name(old))
            self.retired.append(old)
        return transfer_s, time.monotonic() - started

    def close(self) -> list[str]:
        """Unload every version this run left on the server; returns the errors, if any (the
        run's own outcome matters more than a failed clean-up, which is reported)."""
        errors = []
        while self.live:
            name = self.adapter_name(self.live.popleft())
            try:
                self.admin.unload_lora_adapter(name)
            except (RuntimeError, OSError) as error:  # the server may be gone: go on
                errors.append(f"unloading {name}: {error}")
        return errors


class SyncCheck:
    """A weight sync proven, not assumed: the server samples a fixed canary prompt under the
    version just loaded (seeded, at the run's temperature), and the trainer scores those tokens
    with the weights it synced. The mean |difference| of the two log-probs must stay within
    `tolerance` nats, or the run stops naming the version: vLLM has reports of adapters loaded
    with HTTP 200 that serve the base model (mismatched module prefixes), and raw log-probs
    instead of processed ones (without `--logprobs-mode processed_logprobs`) differ as soon as
    the temperature is not 1. An adapter that still equals the base (version 0) passes by
    construction; a served model within the tolerance of the trained one is harmless to the
    importance ratio, which corrects what remains."""

    def __init__(self, admin, score, prompt_ids: list[int], temperature: float, seed: int,
                 tolerance: float, tokens: int = 8):
        self.admin, self.score, self.prompt_ids = admin, score, list(prompt_ids)
        self.temperature, self.seed, self.tolerance, self.tokens = (
            temperature, seed, tolerance, tokens)
        self.differences: list[float] = []  # one per check, for the run's metrics

    def __call__(self, name: str) -> None:
        reply = self.admin.complete(name, self.prompt_ids, self.tokens, self.temperature,
                                    self.seed)
        if not reply.token_ids:
            return  # an immediate end of sequence: nothing to compare
        mine = self.score(self.prompt_ids, reply.token_ids)  # the trainer's log-probs
        difference = sum(abs(a - b) for a, b in zip(mine, reply.logprobs)) / len(mine)
        self.differences.append(difference)
        if not difference <= self.tolerance:  # NaN fails too
            raise RuntimeError(
                f"weight sync check failed for {name}: the server's log-probs of the canary's "
                f"{len(mine)} tokens differ from the trainer's by {difference:.4g} nats on "
                f"average (weight_sync_check_tolerance {self.tolerance:g}), so it does not serve "
                "the weights just synced. Causes seen: an adapter loaded but not applied, a "
                "server started without --logprobs-mode processed_logprobs, another dtype, a "
                "LoRA load that reached one replica of several")


def refuse_unfit_server(base_url: str, metrics: dict | None, adapters: int) -> None:
    """Stop before the first sync when a running server cannot hold this run's versions, from
    what its /metrics says (a server without them is given the benefit of the doubt): vLLM
    silently evicts adapters beyond --max-loras, and with several engine cores (data
    parallel) a LoRA load reaches one of them only."""
    if not metrics:
        return
    engines = metrics.get("engines") or set()
    if len(engines) > 1:
        raise RuntimeError(
            f"the server at {base_url} runs {len(engines)} engine cores (data-parallel "
            "replicas): a LoRA load reaches one of them, the others would sample the old "
            "policy. Serve each trainer from one engine (--data-parallel-size 1 and "
            "--api-server-count 1)")
    if metrics.get("max_loras", adapters) < adapters:
        raise RuntimeError(
            f"the server at {base_url} holds {metrics['max_loras']} LoRA adapters at once "
            f"(--max-loras) and this run needs {adapters} (max_staleness + 1 live versions and "
            f"the one being loaded): restart it with --max-loras {adapters} or more, or lower "
            "max_staleness")
