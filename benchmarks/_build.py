"""Not a benchmark: the helper the benchmarks import to build what they need with the
pipeline's own Snakemake targets (so it prints no figures of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def snakemake(*targets: str, configfile: str | None = None) -> None:
    """Run `snakemake --cores all <targets>` with this interpreter. Its folder goes first on
    PATH because the rules' shells call `python`: a venv's interpreter run without activating
    the venv would otherwise leave them on a Python without reprorl."""
    # the targets before --configfile, which takes every word after it as a file
    command = [sys.executable, "-m", "snakemake", "--cores", "all", *targets]
    if configfile is not None:
        command += ["--configfile", configfile]
    env = {**os.environ,
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    print("building first:", " ".join(command), flush=True)
    subprocess.run(command, check=True, env=env)


def ensure_built(model_path: str, configfile: str | None = None) -> None:
    """The profile's base model and corpus, built by their Snakemake targets when missing."""
    from reprorl.core import layout

    targets = [target for target, ready in (
        ("base_model", all(Path(model_path, name).is_file()
                           for name in ("config.json", "tokenizer.json"))),
        # what the rule declares: a corpus missing another file is corpus.read's error to name
        ("prepare", layout.CORPUS_MANIFEST.is_file())) if not ready]
    if targets:
        snakemake(*targets, configfile=configfile)
