"""The corpus as the stages read it: its file contract and the held-out discipline.

OfficeHelpPrefs-v1 (revision reprorl-r1) is written once by the `prepare` stage (`prepare.py`,
which says how it is made) under `layout.CORPUS`, with a manifest of every file's sha256. Every
other stage reads it through `read`, which checks the file against that manifest, records it as
an input, and refuses what the stage's scope may not see: learning never sees test or probe
inputs nor the gold labels; generation sees the prompts only.
"""

from __future__ import annotations

from pathlib import Path

from reprorl.core.errors import HeldOutError, ReproError
from reprorl.core.layout import CORPUS, CORPUS_MANIFEST
from reprorl.core.manifest import read_json, record_read, sha256_file

DATASET, REVISION = "OfficeHelpPrefs-v1", "reprorl-r1"
# The corpus files (the seed's file contract), under layout.CORPUS; labels under labels/, which
# generation jobs never see (layout.HIDDEN_FROM_GENERATION)
PAGES = "input/pages.json"  # every pair and probe prompt, without its label
GOLD = "labels/gold.json"  # those prompts' labels: what the rubric judges answers against
TRAIN_PAIRS = "labels/train-pairs.json"  # what the reward model learns from
VALIDATION_PAIRS = "labels/validation-pairs.json"  # what SFT, reward and curves measure
PAIRS = {"train": TRAIN_PAIRS, "validation": VALIDATION_PAIRS}
VALIDATION_PAGES = "validation/pages.json"  # the validation pairs' prompts
ROLLOUT_PROMPTS = "train/pages.json"  # the 672 rollout prompts, from the train families only
ROLLOUT_LABELS = "labels/rollouts.json"  # the situation behind each rollout prompt
DEMOS = "warmstart/pages.json"  # SFT's demonstrations
DEMO_LABELS = "labels/warmstart.json"  # their situations
MANIFEST = CORPUS_MANIFEST.relative_to(CORPUS).as_posix()
CORPUS_FILES = (PAGES, GOLD, *PAIRS.values(), VALIDATION_PAGES, ROLLOUT_PROMPTS, DEMOS,
                DEMO_LABELS, ROLLOUT_LABELS, MANIFEST)
# What each kind of stage may read (held-out discipline, enforced by `read`): learning never
# sees test or probe inputs nor the gold labels; generation sees inputs only.
SCOPES = {
    "learning": {DEMOS, DEMO_LABELS, *PAIRS.values(), VALIDATION_PAGES, ROLLOUT_PROMPTS},
    "generation": {PAGES},
    # GRPO with the rubric as verifier learns from the situations of the *train* rollout
    # prompts (the task's true criterion); it sees nothing held out.
    "verifier": {ROLLOUT_PROMPTS, ROLLOUT_LABELS},
    "evaluation": set(CORPUS_FILES) - {MANIFEST},
}


def read(name: str, scope: str):
    """One corpus file, if `scope` may see it, after checking its sha256 against the corpus
    manifest; recorded as an input of the running stage."""
    content = _verified(name, scope)
    record_read(CORPUS / name)
    return content


def _verified(name: str, scope: str):
    if name not in SCOPES[scope]:
        raise HeldOutError(
            f"a {scope} stage may not read {CORPUS / name} (held-out discipline); it may "
            f"read {sorted(SCOPES[scope])}"
        )
    path = CORPUS / name
    if not path.is_file():
        raise ReproError(f"{path} is missing: run the prepare stage (snakemake prepare)")
    recorded = read_json(CORPUS_MANIFEST)["files"].get(name)
    if sha256_file(path) != recorded:
        raise ReproError(
            f"{path} does not match the sha256 in {CORPUS_MANIFEST}: the corpus "
            f"was modified; restore it (or move {CORPUS} away and rerun prepare)"
        )
    content = read_json(path)
    if scope in LEARNING_SCOPES:
        refuse_held_out(path, content, scope)
    return content


def rollout_prompts() -> list[dict]:
    """The 672 rollout prompts PPO and GRPO learn from, checked to be exactly those."""
    pages = read(ROLLOUT_PROMPTS, "learning")
    if len(pages) != 672 or any(p["population"] != "rollout" for p in pages):
        raise ReproError(f"expected the 672 rollout prompts, found {len(pages)}")
    return pages


LEARNING_SCOPES = ("learning", "verifier")
HELD_OUT_SPLITS = ("test", "probe")


def refuse_held_out(path: Path, rows: list[dict], scope: str) -> None:
    """Second line of the held-out discipline, behind the scopes: a file a learning stage reads
    must not hold a test or probe row (same prompt or document id), even under a manifest that
    vouches for it (a generator that leaked them would sign its own output)."""
    # looked at here, never handed out (nor recorded as an input of the learning stage)
    pages = _verified(PAGES, "evaluation")
    held_out = {key for r in pages if r["split"] in HELD_OUT_SPLITS
                for key in (r["prompt"], r["document_id"])}
    leaked = [r.get("document_id") or r.get("prompt") for r in rows
              if r.get("prompt") in held_out or r.get("document_id") in held_out]
    if leaked:
        raise HeldOutError(
            f"{path} holds {len(leaked)} held-out (test or probe) row(s), e.g. {leaked[0]!r}: "
            f"a {scope} stage must never see them; fix the corpus generator's splits and "
            "regenerate the corpus (move {CORPUS} away, then snakemake prepare)")
