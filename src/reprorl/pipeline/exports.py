"""Final exports: a trained role's learned tensors, written once, verified on every read.

`<name>-final.safetensors` holds the adapters (and scalar head) of a role; the JSON beside it
records the file's sha256, the role's kind and the identity of the run that trained it. An
actor's adapters are also written in PEFT format (`<name>-peft/`), which `peft` and vLLM load.
A reader checks the sha256 before building anything from the file, and records both files as
inputs of the running stage.
"""

from __future__ import annotations

from pathlib import Path

from reprorl.core import layout
from reprorl.core.errors import ReproError
from reprorl.core.manifest import (
    atomic_write_bytes,
    read_json,
    record_read,
    sha256_file,
    write_json,
)
from reprorl.model import lora
from reprorl.model.roles import (
    LORA_ALPHA,
    LORA_RANK,
    Role,
    build,
    frozen_identity,
    learned_identity,
    learned_state,
)


def save_final(role: Role, name: str, run_identity: dict, config: dict) -> None:
    """Write `name`'s final export, reload it to verify, and for an actor the PEFT copy."""
    from safetensors.torch import load_file, save

    path = layout.final(name)
    state = {n: t.detach().contiguous() for n, t in learned_state(role).items()}
    atomic_write_bytes(path, save(state))
    write_json(layout.final_manifest(name), {
        "kind": role.kind, "sha256": sha256_file(path), "identity": run_identity,
        "learned_identity": learned_identity(role),
        "frozen_identity": frozen_identity(role),
    })
    reloaded = build(role.kind, config["model"], learned=load_file(path))
    if learned_identity(reloaded) != learned_identity(role):
        raise ReproError(f"{path} does not reload to the trained {name} tensors")
    if role.kind == "actor":
        lora.export_peft(role.backbone, layout.peft(name), config["model"]["path"], LORA_RANK,
                         LORA_ALPHA)


def verified_final(name: str) -> tuple[Path, dict]:
    """A final export's path and manifest, after checking the file's sha256 against it."""
    path, manifest = layout.final(name), layout.final_manifest(name)
    meta = read_json(manifest)
    if sha256_file(path) != meta["sha256"]:
        raise ReproError(f"{path} does not match the sha256 in {manifest}: the checkpoint is "
                         "corrupted; rerun the resume branch")
    record_read(path, manifest)
    return path, meta


def load_final(name: str, kind: str, config: dict, adapters_only: bool = False):
    """A role built from a final export, after checking the file against its manifest."""
    from safetensors.torch import load_file

    path, meta = verified_final(name)
    role = build(kind, config["model"], learned=load_file(path), adapters_only=adapters_only)
    return role, meta
