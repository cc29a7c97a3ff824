"""Corpus populations, invariants, file contract and preservation."""

import json
import re
from pathlib import Path

import pytest

from reprorl.core.manifest import PreservedArtifactError, ReproError, read_json, sha256_file
from reprorl.pipeline import corpus, prepare
from reprorl.pipeline.rubric import evaluate_response


@pytest.fixture(scope="module")
def generated():
    return prepare.generate()


def test_audit_shows_the_seed_numbers(generated):
    summary = prepare.audit(generated)
    assert (summary["dataset"], summary["revision"]) == ("OfficeHelpPrefs-v1", "reprorl-r1")
    assert summary["pairs"] == 1200
    assert summary["pairs_by_split"] == {"train": 840, "validation": 180, "test": 180}
    assert summary["families_by_split"] == {"train": 168, "validation": 36, "test": 36}
    assert summary["warmstart_demonstrations"] == 168
    assert summary["rollout_prompts"] == 672
    assert summary["distinct_pair_demo_rollout_prompts"] == 2040
    assert summary["probe_rows"] == 80 and summary["unique_probe_contexts"] == 20


def test_generation_is_deterministic(generated):
    assert json.dumps(prepare.generate(), sort_keys=True) == json.dumps(generated, sort_keys=True)


def test_probe_factorial_square(generated):
    labels = {r["document_id"]: r for r in generated["gold"]}
    probes = [r for r in generated["pages"] if r["population"] == "probe"]
    by_family = {}
    for row in probes:
        by_family.setdefault(row["family"], []).append(row)
    assert len(by_family) == 20
    for rows in by_family.values():
        assert len({r["prompt"] for r in rows}) == 1  # same prompt inside a context
        cells = {(labels[r["document_id"]]["candidate_correct"],
                  labels[r["document_id"]]["candidate_polite"]) for r in rows}
        assert cells == {(True, False), (True, True), (False, False), (False, True)}


def test_pretraining_population_is_disjoint(generated):
    task_prompts = {r["prompt"] for r in generated["pages"] + generated["demos"]
                    + generated["rollouts"]}
    task_families = {r["family"] for r in generated["pages"]}
    rows = prepare.pretraining_texts(200, seed=11)
    assert not {p for p, _ in rows} & task_prompts
    families = {re.search(r"\b(?:PRE|OH|PROBE)\d+\b", p).group(0) for p, _ in rows}
    assert all(f.startswith("PRE") for f in families) and not families & task_families
    # answers are spread over gestures independently of the situation
    gestures = {evaluate_response(a, "eos", 0)["gesture"] for _, a in rows}
    assert len(gestures) == 6


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda c: c["rollouts"].pop(), "672 rollout prompts"),
        (lambda c: c["gold"][0].update(chosen=c["gold"][0]["rejected"]), "chosen answer"),
        (lambda c: c["pages"][0].update(prompt=c["pages"][0]["prompt"] + " "), "sha256"),
        (lambda c: c["pages"][-1].update(family="OH000"), "probe families"),
    ],
)
def test_audit_catches_broken_invariants(generated, breakage, message):
    broken = json.loads(json.dumps(generated))
    breakage(broken)
    with pytest.raises(ReproError, match=message):
        prepare.audit(broken)


class _Run:
    def finish(self, **kwargs):
        self.kwargs = kwargs


def test_the_file_contract_is_the_seeds():
    """The corpus's file names and who may read them, written out: the constants build both
    the writer and `CORPUS_FILES`, so a renamed constant would pass every other test."""
    learning = {"warmstart/pages.json", "labels/warmstart.json", "labels/train-pairs.json",
                "labels/validation-pairs.json", "validation/pages.json", "train/pages.json"}
    files = ("input/pages.json", "labels/gold.json", "labels/train-pairs.json",
             "labels/validation-pairs.json", "validation/pages.json", "train/pages.json",
             "warmstart/pages.json", "labels/warmstart.json", "labels/rollouts.json",
             "manifest.json")
    assert corpus.CORPUS_FILES == files
    assert corpus.SCOPES == {"learning": learning, "generation": {"input/pages.json"},
                             "verifier": {"train/pages.json", "labels/rollouts.json"},
                             "evaluation": set(files) - {"manifest.json"}}


def test_stage_writes_contract_then_keeps_identical_corpus(in_tmp):
    prepare.stage("prepare", {"seed": 49}, _Run(), log=lambda m: None)
    root = Path("data/generated")
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert files == sorted(corpus.CORPUS_FILES)
    manifest = read_json(root / "manifest.json")
    assert manifest["files"]["train/pages.json"] == sha256_file(root / "train/pages.json")
    assert read_json("outputs/data-audit.json")["pairs"] == 1200
    before = {p: sha256_file(p) for p in root.rglob("*") if p.is_file()}
    prepare.stage("prepare", {"seed": 49}, _Run(), log=lambda m: None)  # identical: kept, no error
    assert before == {p: sha256_file(p) for p in root.rglob("*") if p.is_file()}


def test_stage_refuses_to_overwrite_a_different_corpus(in_tmp):
    prepare.stage("prepare", {"seed": 49}, _Run(), log=lambda m: None)
    target = Path("data/generated/train/pages.json")
    target.write_text(target.read_text().replace("OH0", "XX0", 1))
    tampered = sha256_file(target)
    with pytest.raises(PreservedArtifactError, match="data/generated/train/pages.json"):
        prepare.stage("prepare", {"seed": 49}, _Run(), log=lambda m: None)
    assert sha256_file(target) == tampered  # nothing overwritten


def test_stage_refuses_another_seed(in_tmp):
    with pytest.raises(ReproError, match="frozen at seed 49"):
        prepare.stage("prepare", {"seed": 50}, _Run(), log=lambda m: None)
    assert not Path("data").exists()


def test_learning_scopes_never_read_held_out_rows(in_tmp):
    """Scopes first: no learning or verifier stage may open a held-out file. Then contents: a
    learning file holding a test or probe row is refused even when the manifest vouches for
    it (a generator that leaked the row would sign its own output)."""
    prepare.stage("prepare", {"seed": 49}, _Run(), log=lambda m: None)
    for scope in corpus.LEARNING_SCOPES:
        for name in ("input/pages.json", "labels/gold.json"):
            with pytest.raises(corpus.HeldOutError, match="held-out discipline"):
                corpus.read(name, scope)
        for name in corpus.SCOPES[scope]:
            corpus.read(name, scope)  # the real corpus: nothing held out anywhere
    root = Path("data/generated")
    pages = read_json(root / "input/pages.json")
    for split in corpus.HELD_OUT_SPLITS:
        held_out = next(r for r in pages if r["split"] == split)
        rows = read_json(root / "train/pages.json")
        leaked = rows + [{**rows[0], "prompt": held_out["prompt"]}]
        Path(root / "train/pages.json").write_text(json.dumps(leaked))
        manifest = read_json(root / "manifest.json")
        manifest["files"]["train/pages.json"] = sha256_file(root / "train/pages.json")
        Path(root / "manifest.json").write_text(json.dumps(manifest))
        for scope in corpus.LEARNING_SCOPES:
            with pytest.raises(corpus.HeldOutError, match="holds 1 held-out"):
                corpus.read("train/pages.json", scope)
        Path(root / "train/pages.json").write_text(json.dumps(rows))
