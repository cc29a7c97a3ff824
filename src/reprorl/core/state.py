"""Resume states: saved complete, loaded safely, compared exactly.

A state is a plain nest of dicts, lists, numbers, strings and tensors (learned tensors,
optimizer state, RNG states as tensors or lists). It is written with `torch.save` into a gzip
stream of level 1 whose header carries no timestamp and no name, so two equal states are two
byte-identical files. Loading uses `weights_only=True`: only tensors and plain containers come
back, never arbitrary pickled objects, and only files this project wrote are ever loaded.
"""

from __future__ import annotations

import collections
import gzip
import io
import pickle
import random
import struct
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import devices
from .errors import ReproError
from .manifest import atomic_write_bytes, record_read, sha256_file


def save_state(path: str | Path, state: dict) -> dict:
    """Write `state`, every tensor in it on the CPU: a state from a GPU run is read anywhere
    (`resume_check` jobs hold no GPU), and loads back onto the run's device where it is used."""
    buffer = io.BytesIO()
    torch.save(_canonical(state, {}), buffer)
    raw = buffer.getvalue()
    packed = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=1, fileobj=packed, mtime=0) as out:
        out.write(raw)
    atomic_write_bytes(path, packed.getvalue())
    return {"path": str(path), "raw_bytes": len(raw), "gzip_bytes": packed.tell(),
            "sha256": sha256_file(path)}


def _canonical(value: Any, strings: dict[str, str]) -> Any:
    """`value` rebuilt with its tensors on the CPU and every equal string one object. Pickle
    writes a string it has met before as a reference to it, by identity: so a run that read
    part of its history back from a checkpoint (fresh string objects) would write other bytes
    than a run that never stopped (the code's interned literals) for the same state."""
    if isinstance(value, torch.Tensor):
        return value.cpu()  # the same tensor when it is there already
    if isinstance(value, str):
        return strings.setdefault(value, value)
    if type(value) in (dict, collections.OrderedDict):
        return type(value)((_canonical(key, strings), _canonical(child, strings))
                           for key, child in value.items())
    if type(value) in (list, tuple):  # not a subclass (torch.Size, a named tuple): as it is
        return type(value)(_canonical(child, strings) for child in value)
    return value


def load_state(path: str | Path, record: bool = True) -> dict:
    """A state written by `save_state`, recorded as an input of the running stage (unless
    `record` is False: an in-rule checkpoint is scratch, `preempt.py`)."""
    path = Path(path)
    if not path.is_file():
        raise ReproError(f"resume state {path} is missing: run the stage that writes it first")
    if record:
        record_read(path)
    state = _unpickle(path, _gunzip(path))
    if not isinstance(state, dict) or "identity" not in state:  # as ResumableRun.save writes
        what = "a dict without an identity" if isinstance(state, dict) else (
            f"a {type(state).__name__}")
        raise _damaged(path, f"it holds {what}, not a resume state of this project")
    return state


def _gunzip(path: Path) -> bytes:
    try:
        with gzip.open(path, "rb") as handle:
            return handle.read()
    except (OSError, EOFError, zlib.error) as error:  # BadGzipFile is an OSError
        raise _damaged(path, f"not a complete gzip stream: {_first_line(error)}") from error


def _unpickle(path: Path, raw: bytes) -> Any:
    try:
        with warnings.catch_warnings():  # a pickle torch.save did not write warns of its protocol
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as error:
        # torch's message spans lines and advises weights_only=False: keep only its finding
        finding = str(error).partition("WeightsUnpickler error:")[2] or str(error)
        raise _damaged(path, "not a weights-only torch file of tensors and plain "
                             f"containers: {_first_line(finding)}") from error
    except Exception as error:  # damaged bytes fail in many ways (ValueError, KeyError, ...)
        raise _damaged(path, f"{type(error).__name__}: {_first_line(error)}") from error


def _damaged(path: Path, why: str) -> ReproError:
    return ReproError(f"resume state {path} is corrupted ({why}); delete it and rerun the "
                      "stage that writes it")


def _first_line(message: object) -> str:
    """The start of a message: the refusal stays one line."""
    lines = str(message).strip().splitlines()
    return lines[0][:200] if lines else "no message"


# ---------------------------------------------------------------- RNGs


def rng_state(device: torch.device | None = None) -> dict:
    """Python, numpy and torch CPU RNG states, as weights-only-loadable values, and for a run
    on a GPU every GPU's torch RNG state (a CPU run's state has no such entry)."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "python": list(_listify(random.getstate())),
        "numpy": [kind, torch.from_numpy(keys.copy()), position, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
    gpus = devices.cuda_rng_states(device) if device is not None else None
    if gpus is not None:
        state["cuda"] = gpus
    return state


def restore_rng(state: dict) -> None:
    random.setstate(_tuplify(state["python"]))
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy(), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        devices.restore_cuda_rng(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _listify(value):
    return [_listify(v) for v in value] if isinstance(value, tuple) else value


def _tuplify(value):
    return tuple(_tuplify(v) for v in value) if isinstance(value, list) else value


# ---------------------------------------------------------------- exact comparison


def first_difference(a: Any, b: Any, where: str = "state") -> str | None:
    """Where two states first differ (None if bitwise equal). Floats compare exactly."""
    if type(a) is not type(b):
        return f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        same = torch.equal(_bytes(a), _bytes(b))
        return None if same else f"{where}: tensor values differ"
    if isinstance(a, dict):
        if list(a) != list(b) and set(a) != set(b):
            return f"{where}: keys {sorted(map(str, set(a) ^ set(b)))[:5]} differ"
        for key in a:
            found = first_difference(a[key], b[key], f"{where}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: length {len(a)} != {len(b)}"
        for index, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{where}[{index}]")
            if found:
                return found
        return None
    if isinstance(a, float):  # bits, not value: -0.0 differs from 0.0, a NaN from another
        same = struct.pack("<d", a) == struct.pack("<d", b)
        return None if same else f"{where}: {a!r} != {b!r}"
    return None if a == b else f"{where}: {a!r} != {b!r}"


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)
