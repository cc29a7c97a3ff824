"""The `prepare` stage: OfficeHelpPrefs-v1 (revision reprorl-r1), the synthetic helpdesk corpus,
generated, audited and written once (`corpus.py` is how the other stages read it).

Revision reprorl-r1 rebuilds the tutorial's corpus in this project's own words (the templates
below and the phrases of `rubric.py`); docs/pipeline.md ("The corpus") says how it compares.
Populations (seed 49, all fixed by the specification):
- 240 families, 40 per situation; per situation 28/6/6 families go to train/validation/test,
  so the 1,200 preference pairs (5 per family) split 840/180/180 by family.
- 168 SFT demonstrations and 672 rollout prompts, from train families only, each prompt
  literally distinct from every pair prompt (2,040 distinct prompts in all).
- 80 probe rows: 20 new contexts x correct/incorrect advice x polite/plain, the same prompt for
  the four rows of a context, families outside every split. Probes never serve learning.
The base model learns on a third, disjoint population (`pretraining_texts`).
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

from reprorl.core.errors import PreservedArtifactError, ReproError
from reprorl.core.layout import CORPUS, DATA_AUDIT
from reprorl.core.manifest import (
    atomic_directory,
    files_under,
    sha256_bytes,
    sha256_file,
    write_json,
)

from .corpus import (
    CORPUS_FILES,
    DATASET,
    DEMO_LABELS,
    DEMOS,
    GOLD,
    MANIFEST,
    PAGES,
    PAIRS,
    REVISION,
    ROLLOUT_LABELS,
    ROLLOUT_PROMPTS,
    VALIDATION_PAGES,
)
from .rubric import CONTEXTS, evaluate_response, response

SEED = 49
FAMILIES, FAMILIES_PER_ACTION, PAIRS_PER_FAMILY = 240, 40, 5
SPLIT_SIZES = {"train": 28, "validation": 6, "test": 6}  # families per situation
PROBE_CONTEXTS = 20
INSTRUCTION = "Suggest one relevant next step and do not promise a guaranteed fix."
NEUTRAL, HEDGED, GUARANTEED = 1, 0, 2


def digest(text: str) -> str:
    return sha256_bytes(text.encode())


def assign_splits(seed: int = SEED) -> dict[int, str]:
    """Family index -> split; each situation's 40 families are shuffled then cut 28/6/6."""
    rng = random.Random(seed)
    assignment = {}
    for action in range(len(CONTEXTS)):
        indices = list(range(action * FAMILIES_PER_ACTION, (action + 1) * FAMILIES_PER_ACTION))
        rng.shuffle(indices)
        cut_train, cut_validation = SPLIT_SIZES["train"], sum(list(SPLIT_SIZES.values())[:2])
        for position, index in enumerate(indices):
            assignment[index] = (
                "train"
                if position < cut_train
                else "validation" if position < cut_validation else "test"
            )
    return assignment


def task_prompt(family: str, action: int, channel: str, variant: int) -> str:
    headings = (
        f"Ticket {family}, entry {variant}.",
        f"Support log {family}, item {variant}.",
        f"Service desk {family}, line {variant}.",
    )
    return f"{headings[variant % 3]} Channel: {channel}. {CONTEXTS[action]} {INSTRUCTION}"


def page(document_id: str, family: str, split: str, prompt: str, population: str) -> dict:
    return {
        "document_id": document_id,
        "family": family,
        "split": split,
        "population": population,
        "prompt": prompt,
        "content_sha256": digest(prompt),
    }


def pair_responses(action: int, variant: int, family_index: int) -> tuple[str, str]:
    """The five pair kinds of a family: what the chosen answer beats and how."""
    wrong = (action + 1 + family_index % 5) % 6
    return {
        0: (response(action, NEUTRAL, False), response(wrong, GUARANTEED, False)),
        1: (response(action, HEDGED, False), response(wrong, NEUTRAL, True)),
        2: (response(action, NEUTRAL, True), response(wrong, HEDGED, False)),
        3: (response(action, NEUTRAL, False), response(action, GUARANTEED, True)),
        4: (response(action, HEDGED, True), response(wrong, NEUTRAL, False)),
    }[variant]


def generate(seed: int = SEED) -> dict[str, list[dict]]:
    """Every population of the corpus, in memory."""
    splits = assign_splits(seed)
    pages, gold, demos, demo_labels, rollouts, rollout_labels = [], [], [], [], [], []
    for index in range(FAMILIES):
        family, action, split = f"OH{index:03d}", index // FAMILIES_PER_ACTION, splits[index]
        for variant in range(PAIRS_PER_FAMILY):
            document_id = f"{family}-P{variant}"
            chosen, rejected = pair_responses(action, variant, index)
            prompt = task_prompt(family, action, "pair review", variant)
            pages.append(page(document_id, family, split, prompt, "pair"))
            gold.append(
                {
                    "document_id": document_id,
                    "expected_action": action,
                    "chosen": chosen,
                    "rejected": rejected,
                }
            )
        if split != "train":
            continue
        document_id = f"{family}-SFT"
        prompt = task_prompt(family, action, "worked example", 7)
        demos.append(page(document_id, family, "train", prompt, "warmstart"))
        demo_labels.append(
            {"document_id": document_id, "response": response(action, NEUTRAL, index % 2 == 0)}
        )
        for variant in range(4):
            prompt = task_prompt(family, action, "live queue", 11 + variant)
            rollouts.append(page(f"{family}-RL{variant}", family, "train", prompt, "rollout"))
            rollout_labels.append({"document_id": f"{family}-RL{variant}",
                                   "expected_action": action})
    probes, probe_labels = probe_rows()
    return {
        "pages": pages + probes,
        "gold": gold + probe_labels,
        "demos": demos,
        "demo_labels": demo_labels,
        "rollouts": rollouts,
        "rollout_labels": rollout_labels,
    }


def probe_rows() -> tuple[list[dict], list[dict]]:
    """20 contexts x {correct, incorrect} x {plain, polite}; one prompt per context."""
    pages, labels = [], []
    for index in range(PROBE_CONTEXTS):
        family, action = f"PROBE{index:02d}", index % 6
        wrong = (action + 1) % 6
        prompt = (
            f"Remote desk, new case {family}. {CONTEXTS[action]} "
            f"An earlier unrelated ticket was closed. {INSTRUCTION}"
        )
        for correct, polite in ((True, False), (True, True), (False, False), (False, True)):
            document_id = f"{family}-C{int(correct)}-P{int(polite)}"
            pages.append(page(document_id, family, "probe", prompt, "probe"))
            labels.append(
                {
                    "document_id": document_id,
                    "expected_action": action,
                    "candidate_response": response(action if correct else wrong, NEUTRAL, polite),
                    "candidate_correct": correct,
                    "candidate_polite": polite,
                }
            )
    return pages, labels


def pretraining_texts(families: int, seed: int) -> list[tuple[str, str]]:
    """(prompt, response) pairs for the base model, from families outside the task corpus.

    Responses are drawn uniformly over gesture x certainty x politeness, independently of the
    situation in the prompt: the base learns the language, not which gesture fits.
    """
    rng = random.Random(seed)
    rows = []
    for index in range(families):
        family = f"PRE{index:04d}"
        action = rng.randrange(len(CONTEXTS))
        for variant in range(4):
            prompt = task_prompt(family, action, "practice note", 21 + variant)
            answer = response(rng.randrange(6), rng.randrange(3), rng.random() < 0.5)
            rows.append((prompt, answer))
    return rows


def audit(corpus: dict[str, list[dict]]) -> dict:
    """Assert every invariant of the specification; return the counts the audit file shows."""
    pages, labels = corpus["pages"], {row["document_id"]: row for row in corpus["gold"]}
    demos, rollouts = corpus["demos"], corpus["rollouts"]

    def check(condition: bool, message: str) -> None:
        if not condition:
            raise ReproError(f"corpus invariant violated: {message}")

    pairs = [r for r in pages if r["population"] == "pair"]
    probes = [r for r in pages if r["population"] == "probe"]
    check(len(pages) == len(labels) == 1280, "1,280 labelled input rows")
    check(len(pairs) == 1200 and len(probes) == 80, "1,200 pair rows and 80 probe rows")
    families = {
        split: {r["family"] for r in pairs if r["split"] == split} for split in SPLIT_SIZES
    }
    check([len(f) for f in families.values()] == [168, 36, 36], "families split 168/36/36")
    for a, b in (("train", "validation"), ("train", "test"), ("validation", "test")):
        check(not families[a] & families[b], f"{a} and {b} families are disjoint")
    pairs_by_split = {s: sum(r["split"] == s for r in pairs) for s in SPLIT_SIZES}
    check(list(pairs_by_split.values()) == [840, 180, 180], "pairs split 840/180/180")
    check(len(demos) == len(corpus["demo_labels"]) == 168, "168 SFT demonstrations")
    check(len(rollouts) == 672, "672 rollout prompts")
    check(
        {r["family"] for r in demos} == families["train"] == {r["family"] for r in rollouts},
        "demonstrations and rollout prompts come from exactly the train families",
    )
    prompts = [r["prompt"] for r in pairs + demos + rollouts]
    check(len(set(prompts)) == 2040, "2,040 distinct pair, demonstration and rollout prompts")
    check(
        all(r["content_sha256"] == digest(r["prompt"]) for r in pages + demos + rollouts),
        "every stored prompt sha256 matches its prompt",
    )
    check(len({r["prompt"] for r in probes}) == PROBE_CONTEXTS, "20 distinct probe contexts")
    check(
        not {r["family"] for r in probes} & set.union(*families.values()),
        "probe families lie outside every split",
    )
    check(not {r["prompt"] for r in probes} & set(prompts), "probe prompts are new")
    for row in pairs:
        gold = labels[row["document_id"]]
        chosen = evaluate_response(gold["chosen"], "eos", gold["expected_action"])
        rejected = evaluate_response(gold["rejected"], "eos", gold["expected_action"])
        check(chosen["rubric_success"], f"chosen answer of {row['document_id']} succeeds")
        check(not rejected["rubric_success"], f"rejected answer of {row['document_id']} fails")
    for row in probes:
        gold = labels[row["document_id"]]
        verdict = evaluate_response(gold["candidate_response"], "eos", gold["expected_action"])
        check(
            verdict["rubric_success"] == gold["candidate_correct"]
            and verdict["polite"] == gold["candidate_polite"],
            f"rubric recovers correctness and politeness of {row['document_id']}",
        )
    return {
        "dataset": DATASET,
        "revision": REVISION,
        "seed": SEED,
        "families": FAMILIES,
        "pairs": len(pairs),
        "pairs_by_split": pairs_by_split,
        "families_by_split": {s: len(f) for s, f in families.items()},
        "warmstart_demonstrations": len(demos),
        "rollout_prompts": len(rollouts),
        "distinct_pair_demo_rollout_prompts": len(set(prompts)),
        "probe_rows": len(probes),
        "unique_probe_contexts": len({r["prompt"] for r in probes}),
        "probe_design": "20 contexts x correct/incorrect x polite/plain, one prompt per context",
        "generations_per_policy": 260,
        "unique_contexts_per_policy": 200,
        "shared_situations": len(CONTEXTS),
        "human_feedback": False,
        "rubric_scope": "finite declared grammar; any other prose is UNCERTIFIED",
    }


def write_corpus(corpus: dict[str, list[dict]], summary: dict, root: Path = CORPUS) -> None:
    """Write the seed's file contract into `root` in one atomic directory move."""
    labels = {row["document_id"]: row for row in corpus["gold"]}
    with atomic_directory(root) as scratch:
        write_json(scratch / PAGES, corpus["pages"])
        write_json(scratch / GOLD, corpus["gold"])
        for split, name in PAIRS.items():
            selected = [
                r for r in corpus["pages"] if r["split"] == split and r["population"] == "pair"
            ]
            pairs = [
                {
                    "document_id": r["document_id"],
                    "family": r["family"],
                    "prompt": r["prompt"],
                    "expected_action": labels[r["document_id"]]["expected_action"],
                    "chosen": labels[r["document_id"]]["chosen"],
                    "rejected": labels[r["document_id"]]["rejected"],
                }
                for r in selected
            ]
            write_json(scratch / name, pairs)
            if split == "validation":
                write_json(scratch / VALIDATION_PAGES, selected)
        write_json(scratch / ROLLOUT_PROMPTS, corpus["rollouts"])
        write_json(scratch / DEMOS, corpus["demos"])
        write_json(scratch / DEMO_LABELS, corpus["demo_labels"])
        # the situation behind each rollout prompt: for judging sampled responses afterwards
        # (evaluation scope); PPO and GRPO never read it
        write_json(scratch / ROLLOUT_LABELS, corpus["rollout_labels"])
        hashes = {p.relative_to(scratch).as_posix(): sha256_file(p) for p in files_under(scratch)}
        write_json(scratch / MANIFEST, {**summary, "files": hashes})
        if set(hashes) | {MANIFEST} != set(CORPUS_FILES):
            raise ReproError(f"corpus files {sorted(hashes)} differ from the contract")


def stage(name: str, config: dict, run, log=print) -> dict:
    """Stage `prepare`: generate and audit the corpus; write it unless it is already there.

    The corpus is preserved: an existing corpus folder is never overwritten. If it holds
    exactly what this code generates, it is kept and re-recorded; if it differs in any byte, the
    stage stops and names the first differing file. For that reason the Snakemake rule declares
    only the manifest and the audit file as outputs (Snakemake deletes declared outputs before
    re-running a job, which would defeat the guard); the manifest lists every corpus file's
    sha256 and later stages verify what they read against it.
    """
    if config["seed"] != SEED:
        raise ReproError(
            f"seed is {config['seed']}, but OfficeHelpPrefs-v1 is frozen at seed {SEED}: "
            "a different corpus is a new revision, not this one"
        )
    corpus = generate(SEED)
    summary = audit(corpus)
    if CORPUS.exists() and files_under(CORPUS):
        with tempfile.TemporaryDirectory() as scratch:
            fresh = Path(scratch) / "generated"
            write_corpus(corpus, summary, fresh)
            expected = {p.relative_to(fresh): sha256_file(p) for p in files_under(fresh)}
        present = {p.relative_to(CORPUS): sha256_file(p) for p in files_under(CORPUS)}
        for name in sorted(set(expected) | set(present)):
            if expected.get(name) != present.get(name):
                raise PreservedArtifactError(
                    f"{CORPUS / name} is not what this code generates "
                    f"({'missing' if name not in present else 'different or extra'}), and the "
                    f"corpus is preserved, so nothing was overwritten. Move {CORPUS} away to "
                    "generate a new revision, or restore the original file."
                )
        log(f"{CORPUS} already holds this exact corpus: kept as it is")
    else:
        write_corpus(corpus, summary)
        log(f"corpus written to {CORPUS}: {summary['pairs_by_split']} pairs, "
            f"{summary['probe_rows']} probe rows")
    write_json(DATA_AUDIT, summary)
    run.finish(inputs=[], outputs=[CORPUS, DATA_AUDIT], summary=summary)
    return summary
