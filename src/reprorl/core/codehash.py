"""Hash of the code a stage runs, so Snakemake re-runs a stage when its modules change.

Snakemake tracks a rule's own text but not the modules its command imports. Each rule therefore
carries `params: code=code_hash(stage)`; a changed hash is a changed param, which re-runs the rule
and everything downstream of it, and nothing else. The hash covers the stage's entry module and
every `reprorl` module it imports, found statically (no import is executed). The config schema
is left out: its effect (the filled-in values) is already in the stage's config param. `cli.py`
only parses arguments and is left out too.
"""

from __future__ import annotations

import ast
import hashlib
from functools import cache
from pathlib import Path

from .stages import STAGES

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # src/reprorl


def _module_file(name: str) -> Path:
    path = PACKAGE_DIR.joinpath(*name.split(".")).with_suffix(".py")
    return path if path.is_file() else PACKAGE_DIR.joinpath(*name.split("."), "__init__.py")


def _imports(name: str) -> set[str]:
    """reprorl modules imported by module `name` (relative or absolute imports)."""
    tree = ast.parse(_module_file(name).read_text())
    package = name.rpartition(".")[0] if not _module_file(name).name == "__init__.py" else name
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                base = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("reprorl"):
                target = node.module.removeprefix("reprorl").lstrip(".")
            else:
                continue
            candidates = [f"{target}.{alias.name}".strip(".") for alias in node.names]
            for candidate in [target, *candidates]:
                if candidate and _module_file(candidate).is_file():
                    found.add(candidate)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("reprorl."):
                    found.add(alias.name.removeprefix("reprorl."))
    return found


def module_closure(entry: str) -> list[str]:
    seen, todo = set(), [entry]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_imports(name) - seen)
    return sorted(seen)


@cache
def code_hash(stage: str) -> str:
    digest = hashlib.sha256()
    for path in [_module_file(m) for m in module_closure(STAGES[stage].module)]:
        digest.update(path.relative_to(PACKAGE_DIR).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()
