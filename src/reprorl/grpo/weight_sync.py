"""Weight versions published to the generation server: `AdapterVersions` through its LoRA path,
`MergedVersions` as full weights (full-model training).

Version N is a PEFT adapter written atomically under `<directory>/v<N>/` and loaded as
`served_name(name, N)`, where `name` is unique to the trainer's run (`policy-<tag>`): a
long-lived server (`vllm serve` shared by several runs) may still hold another run's versions,
and a name it already has is refused. The newest `keep` versions stay loaded (`max_staleness +
1`: every sample the trainer may still accept was sampled under one of them); older ones are
unloaded, and their files deleted one publish later, because vLLM reloads an adapter it evicted
from its cache lazily, from its path, for a request already queued. `close()` unloads what the
run left loaded. After each load, `check(name)` (when given) asks the server to prove it serves
the new weights (the trainer's canary: `SyncCheck` below). Neither sync pauses the server or
waits on another process; merged weights travel through a file and vLLM's `reload_weights`.
docs/grpo.md lists where it departs from the seed (TRL).
"""

from __future__ import annotations

import collections
import shutil
import time
from pathlib import Path


def version_folder(directory: Path, version: int) -> Path:
    """Where `version`'s weights are written under `directory` (a checkpoint keeps a fixed
    schedule's older versions in the same layout, under its `versions/`)."""
    return Path(directory) / f"v{version}"


def live_versions(max_staleness: int) -> int:
    """Adapter versions kept loaded: every sample the trainer may still accept was sampled
    under one of the `max_staleness + 1` newest."""
    return max_staleness + 1


def lora_slots(max_staleness: int) -> int:
    """Adapters a server must hold at once (its --max-loras): the live versions and the new
    one, loaded before the oldest is unloaded."""
    return live_versions(max_staleness) + 1


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
            shutil.rmtree(version_folder(self.directory, old), ignore_errors=True)
        self.retired = []
        directory = version_folder(self.directory, version)
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


class MergedVersions:
    """Full weights, one version served at a time (`use_peft=False`).

    Version N is the policy as `save_pretrained` writes it, under `<directory>/v<N>/`, loaded
    into the server in place (`ServerAdmin.reload_weights`: vLLM's `/collective_rpc
    reload_weights`, then `/reset_prefix_cache`) and served under the model's own name. The
    server holds no older version: a rollout running across a sync finishes under the new
    weights (its sampler log-probs are the ones it sampled with, which the importance ratio
    reads), and its samples keep the version they started under, so their staleness counts from
    the oldest weights that made them. A version's files are deleted one publish later, as
    `AdapterVersions` does. The server must serve the model under `model_path`, the
    trainer's (vLLM's default name for `--model` that path). `close()` reloads `model_path`
    once any reload was asked for, even one that failed half-way, so a long-lived server shared
    with other runs serves what it served before.
    """

    name = None  # no adapter name: the worker samples the model's own name

    def __init__(self, admin, directory: Path, model_path: str, version, export, check=None):
        self.admin, self.directory, self.model_path = admin, Path(directory), model_path
        self.version, self.export, self.check = version, export, check
        self.current: int | None = None  # the version whose files the server was given last
        self.retired: list[int] = []
        self.changed = False  # a reload was asked for: close() must put the base back

    def adapter_name(self, version: int) -> str:
        return self.model_path

    def publish(self, version: int, source: Path | None = None) -> tuple[float, float]:
        """Make `version` (the policy's weights now) the served policy; returns (transfer
        seconds, total seconds)."""
        if source is not None:
            raise ValueError("merged weights serve one version: a fixed schedule that samples "
                             "older versions needs LoRA (use_peft=True)")
        started = time.monotonic()
        for old in self.retired:
            shutil.rmtree(version_folder(self.directory, old), ignore_errors=True)
        self.retired = [] if self.current is None else [self.current]
        directory = version_folder(self.directory, version)
        shutil.rmtree(directory, ignore_errors=True)
        self.export(directory)
        self.changed, self.current = True, version  # before the call: it may half-succeed
        self.admin.reload_weights(str(directory.resolve()))
        transfer_s = time.monotonic() - started
        if self.check is not None:
            self.check(self.model_path)
        self.version.value = version
        return transfer_s, time.monotonic() - started

    def close(self) -> list[str]:
        """Put the server's starting weights back; returns the error, if any."""
        if not self.changed:
            return []
        self.changed = False
        try:
            self.admin.reload_weights(self.model_path)
        except (RuntimeError, OSError) as error:  # the server may be gone: go on
            return [f"reloading the starting weights from {self.model_path}: {error}"]
        return []


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
                 tolerance: float, tokens: int = 8, hint: str = ""):
        self.admin, self.score, self.prompt_ids = admin, score, list(prompt_ids)
        self.hint = hint  # a cause this run's setting makes likely, said after the usual ones
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
                "LoRA load that reached one replica of several" + self.hint)


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
            "replicas): a LoRA load reaches one of them (a full-weight reload is not known "
            "to reach them all), the others would sample the old policy. Serve each trainer "
            "from one engine (--data-parallel-size 1 and "
            "--api-server-count 1)")
    if metrics.get("max_loras", adapters) < adapters:
        raise RuntimeError(
            f"the server at {base_url} holds {metrics['max_loras']} LoRA adapters at once "
            f"(--max-loras) and this run needs {adapters} (max_staleness + 1 live versions and "
            f"the one being loaded): restart it with --max-loras {adapters} or more, or lower "
            "max_staleness")
