"""constraints/cpu.txt is a complete lock of what the README's install command installs."""

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the lock is made on 3.11
ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, str]:
    lines = [line for line in (ROOT / "constraints/cpu.txt").read_text().splitlines()
             if line and not line.startswith("#")]
    for line in lines:
        assert re.fullmatch(r"[A-Za-z0-9._-]+==[A-Za-z0-9.+!_-]+", line), (
            f"{line!r} is not an exact pin: renew the lock with `python constraints/lock.py`")
    return {canonicalize_name(name): version
            for name, version in (line.split("==") for line in lines)}


def _closure(requirements: list[str], extras: set[str], project: dict) -> set[str]:
    """Every distribution `requirements` (with `extras` asked for) bring in on this Python;
    the project's own extras (`reprorl[loggers]` in the test extra) read from `project`."""
    found, pending = set(), [(Requirement(r), extras) for r in requirements]
    while pending:
        requirement, asked = pending.pop()
        if requirement.marker and not any(requirement.marker.evaluate({"extra": extra})
                                          for extra in asked | {""}):
            continue
        name = canonicalize_name(requirement.name)
        if name == canonicalize_name(project["name"]):
            pending += [(Requirement(r), set()) for extra in requirement.extras
                        for r in project["optional-dependencies"][extra]]
            continue
        if (name, frozenset(requirement.extras)) in found:
            continue
        found.add((name, frozenset(requirement.extras)))
        pending += [(Requirement(r), set(requirement.extras))
                 for r in metadata.requires(name) or []]
    return {name for name, _ in found}


def test_the_lock_pins_every_distribution_the_test_install_brings_at_its_installed_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = _closure([*project["dependencies"], *project["optional-dependencies"]["test"]],
                      set(), project)
    pins = _pins()
    assert needed - set(pins) == set(), "unpinned: renew with `python constraints/lock.py`"
    drift = {name: (pins[name], metadata.version(name)) for name in needed
             if metadata.version(name) != pins[name]}
    assert drift == {}, "this environment is not the locked one (lock, installed)"
