"""`numerics: native | portable`: which CPU kernels a process may pick, fixed before torch loads.

`native` lets every library take the fastest kernels this CPU offers, so the bits depend on the
CPU type (AVX-512 rounds otherwise than AVX2 from the first pretraining step on). `portable`
fixes each choice that depends on the CPU to one any x86-64 CPU with AVX2 and FMA can run, so
that two such machines compute the same bits: ATen's vector kernels, MKL's code path (conditional
numerical reproducibility: its vendor-neutral branch, strict), oneDNN's instruction set,
NumPy's SIMD dispatch and its OpenBLAS core, and the threads (the stage's declared count,
whatever the machine has).

`pin` sets the environment of this process before torch is imported; every process a stage
starts (rollout worker, generation server, torchrun ranks) inherits it, and `check` in each
refuses to go on if torch ignored it. docs/reproducibility.md says what was measured.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .errors import ConfigError, ReproError

MODES = ("native", "portable")
# set for the process and its children; REPRORL_NUMERICS tells a child which mode it runs in
PORTABLE = {
    "ATEN_CPU_CAPABILITY": "avx2",
    # MKL keeps a vendor's own code path under MKL_CBWR=AVX2 (its matrix products and exp gave
    # other bits on an Intel CPUID than on an AMD one); only COMPATIBLE runs one path on both.
    # STRICT: its results also stop depending on its thread count and data alignment
    "MKL_CBWR": "COMPATIBLE,STRICT",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ONEDNN_DEFAULT_FPMATH_MODE": "STRICT",
    # NumPy dispatches its loops (sums included) up to AVX-512 where it finds it
    "NPY_ENABLE_CPU_FEATURES": "X86_V3",
    # the bootstrap's matrix products run on NumPy's OpenBLAS, which picks a kernel per core type
    "OPENBLAS_CORETYPE": "Haswell",
    "OPENBLAS_NUM_THREADS": "1",
}
# How every pipeline stage builds AdamW, in both modes: fused, one ATen kernel. The default
# (foreach) update takes float32 sqrt from a library routine that is not correctly rounded: its
# bits differed between CPU types under every MKL_CBWR, where the fused kernel's agreed
# (benchmarks/RESULTS.md, "Portable numerics").
ADAMW = {"fused": True}
CAPABILITY = "AVX2"  # what torch must report once the pins took hold
REQUIRED_FLAGS = ("avx2", "fma", "f16c")  # /proc/cpuinfo flags the pinned kernels execute
MODE_VARIABLE = "REPRORL_NUMERICS"


def mode() -> str:
    """The mode this process was pinned to (by `pin` here or in a parent); native if none."""
    return os.environ.get(MODE_VARIABLE, "native")


def cpuinfo() -> dict[str, str]:
    """The first processor's entries of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def refuse_unportable(config: dict) -> None:
    """A config whose `portable` promise cannot hold is refused, naming what to change."""
    if config.get("numerics") != "portable":
        return
    if config["model"]["device"] != "cpu":
        raise ConfigError(
            f"numerics: portable pins CPU kernels, but model.device is "
            f"{config['model']['device']!r} (a GPU's bits depend on the GPU); set model.device: "
            "cpu, or numerics: native")


def pin(wanted: str) -> None:
    """Fix this process's kernel choices for `wanted` before torch is imported; children
    inherit them. Refused once torch is loaded (ATen and MKL read them only once)."""
    if wanted not in MODES:
        raise ConfigError(f"numerics must be one of {MODES}, not {wanted!r}")
    if wanted == "native":
        if mode() == "portable":
            raise ReproError("this process inherited numerics: portable from its parent but was "
                             "asked for native; run it from a shell without REPRORL_NUMERICS")
        return
    if "torch" in sys.modules and mode() != "portable":
        raise ReproError("numerics: portable must be set before torch is imported (ATen and "
                         "MKL read their settings once); start a fresh process")
    flags = cpuinfo().get("flags")
    if flags is not None and (missing := [f for f in REQUIRED_FLAGS if f not in flags.split()]):
        raise ReproError(f"numerics: portable runs AVX2 kernels, but this CPU lacks "
                         f"{', '.join(missing)}; set numerics: native")
    os.environ.update(PORTABLE)
    os.environ[MODE_VARIABLE] = "portable"


def check() -> None:
    """In a process that should run portable kernels, refuse to go on if torch does not."""
    if mode() != "portable":
        return
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    changed = {k: os.environ.get(k) for k, v in PORTABLE.items() if os.environ.get(k) != v}
    if capability != CAPABILITY or changed:
        raise ReproError(
            f"numerics: portable, but torch runs {capability} kernels (wanted {CAPABILITY}) "
            f"and the environment overrides {changed or 'nothing'}; unset those variables")


def threads(declared: int, asked: int | None, wanted: str) -> int:
    """Torch threads of a stage: in portable mode always the declared count (ATen splits a
    reduction across threads, so the count is part of the bits, and Snakemake lowers a rule's
    threads to --cores), else what the caller asked."""
    return declared if wanted == "portable" or asked is None else asked
