"""The package's layers: each imports only those below it, and every module stays short.

    cli  ->  pipeline  ->  grpo  ->  serve  ->  model  ->  core

A newcomer reads where a change belongs from the package list; these tests keep that list
true. Imports are read statically (inside functions too), as the code hash reads them.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from reprorl.core.codehash import PACKAGE_DIR, _imports

LAYERS = ("core", "model", "serve", "grpo", "pipeline")
TOP = ("__init__", "__main__", "cli")  # above every layer


def modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR).with_suffix("").parts)
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1
                              else parts))
    return names


def layer(module: str) -> int:
    package = module.split(".")[0]
    if package in TOP:
        return len(LAYERS)
    assert package in LAYERS, f"reprorl.{module} is in no layer: move it into one of {LAYERS}"
    return LAYERS.index(package)


@pytest.mark.parametrize("module", modules())
def test_a_module_imports_only_its_own_layer_and_those_below(module):
    upward = sorted(target for target in _imports(module) if layer(target) > layer(module))
    assert not upward, f"reprorl.{module} imports a higher layer: {upward}"


def test_every_module_is_under_500_lines_and_few_sit_at_the_top():
    long = {path.relative_to(PACKAGE_DIR).as_posix(): lines
            for path in PACKAGE_DIR.rglob("*.py")
            if (lines := len(path.read_text().splitlines())) > 500}
    assert not long, f"modules over 500 lines: {long}"
    top = sorted(path.name for path in PACKAGE_DIR.glob("*.py"))
    assert len(top) <= 8, f"{len(top)} modules directly in src/reprorl: {top}"


def test_the_layer_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check itself: a core module that imports the pipeline is caught."""
    import reprorl.core.codehash as codehash

    fake = tmp_path / "reprorl"
    (fake / "core").mkdir(parents=True)
    (fake / "pipeline").mkdir()
    for package in ("core", "pipeline"):
        (fake / package / "__init__.py").write_text("")
    (fake / "core" / "paths.py").write_text("from reprorl.pipeline import ppo\n")
    (fake / "pipeline" / "ppo.py").write_text("from ..core import paths\n")
    monkeypatch.setattr(codehash, "PACKAGE_DIR", fake)
    assert _imports("core.paths") == {"pipeline", "pipeline.ppo"}
    assert _imports("pipeline.ppo") == {"core", "core.paths"}


def test_reprorl_serve_loads_no_trainer_or_pipeline_code():
    """`reprorl serve` (the CLI verb, up to its argument parsing) imports nothing from the
    trainer library or the pipeline."""
    code = ("import sys\n"
            "from reprorl import cli\n"
            "try:\n"
            "    cli.main(['serve', '--help'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "print(sorted(m for m in sys.modules\n"
            "             if m.startswith(('reprorl.grpo', 'reprorl.pipeline'))))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=300)
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout
