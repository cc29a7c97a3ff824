"""`AdapterVersions`: weight versions published to the generation server through its LoRA path.

Version N is a PEFT adapter written atomically under `<directory>/v<N>/` and loaded as
`<name>-v<N>`; the newest `keep` versions stay loaded (`max_staleness + 1`: every sample the
trainer may still accept was sampled under one of them), older ones are unloaded first and
then deleted. Departure from the seed (TRL): no merged full-weight sync, so the server is never
paused and no other process is waited on; of the seed's pause/barrier/transfer split only the
transfer (write + load) exists.
"""

from __future__ import annotations

import collections
import shutil
import time
from pathlib import Path


class AdapterVersions:
    def __init__(self, admin, directory: Path, name: str, keep: int, version, export):
        self.admin = admin  # load_lora_adapter(name, path), unload_lora_adapter(name)
        self.directory, self.name, self.keep = Path(directory), name, keep
        self.version = version  # shared .value: the newest published version (read by the worker)
        self.export = export  # export(directory): writes the policy's adapter there
        self.live: collections.deque[int] = collections.deque()

    def adapter_name(self, version: int) -> str:
        return f"{self.name}-v{version}"

    def publish(self, version: int, source: Path | None = None) -> tuple[float, float]:
        """Make `version` the served policy (the policy's weights now, or the adapter stored
        at `source`); returns (transfer seconds, total seconds)."""
        started = time.monotonic()
        directory = self.directory / f"v{version}"
        shutil.rmtree(directory, ignore_errors=True)
        if source is None:
            self.export(directory)
        else:
            shutil.copytree(source, directory)
        self.admin.load_lora_adapter(self.adapter_name(version), str(directory.resolve()))
        transfer_s = time.monotonic() - started
        self.version.value = version
        self.live.append(version)
        while len(self.live) > self.keep:
            old = self.live.popleft()
            self.admin.unload_lora_adapter(self.adapter_name(old))
            shutil.rmtree(self.directory / f"v{old}", ignore_errors=True)
        return transfer_s, time.monotonic() - started
