"""End to end: the real Snakemake DAG on configs/ci.yaml in a temporary copy.

One module-scoped run builds everything; the tests then probe no-op reruns, the audit, code-edit
invalidation, preserved artifacts and config errors against it.
"""

import collections
import gzip
import json
import os
import pickle
import re
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import copy_workflow, reprorl, snakemake

from reprorl.core import config as configuration
from reprorl.core.layout import FIGURES
from reprorl.core.manifest import read_json, sha256_file, write_json
from reprorl.core.stages import CURVES, EXPORTS, STAGES

pytestmark = pytest.mark.e2e
MODES = ("interrupt", "continuous", "resume", "resume_check")
WARMSTART = {f"{branch}_{mode}" for branch in ("sft", "reward") for mode in MODES}
WARMSTART |= {"sft_validation"}  # the curves' start point
PPO = {f"ppo_{mode}" for mode in MODES} | {"ppo_report", "curve_ppo"}
GRPO = {f"grpo_{run}_{mode}" for run in ("verifier", "learned") for mode in MODES}
GRPO |= {f"{stage}_grpo_{run}" for stage in ("generate", "curve") for run in ("verifier",
                                                                              "learned")}
# what any change to a policy re-runs downstream of it
JUDGING = {"generate_sft", "generate_ppo", "reward_test", "evaluate", "exercise", "report"}


def run(workdir: Path, *args: str, check: bool = True):
    """Snakemake on the CI profile (the config file goes last: it takes several values)."""
    return snakemake(workdir, *args, "--configfile", "configs/ci.yaml", check=check)


@pytest.fixture(scope="module")
def workflow(tmp_path_factory):
    workdir = copy_workflow(tmp_path_factory.mktemp("e2e") / "wf")
    run(workdir)
    return workdir


def planned_rules(workdir: Path, *args: str) -> set[str]:
    """Rules a dry run would execute."""
    out = run(workdir, "-n", *args).stdout
    return set(re.findall(r"^(?:local)?rule (\w+):", out, flags=re.M)) - {"all"}


def test_full_run_outputs(workflow):
    audit = read_json(workflow / "outputs/data-audit.json")
    assert audit["pairs_by_split"] == {"train": 840, "validation": 180, "test": 180}
    assert (workflow / "assets/model/model.safetensors").is_file()
    for check in ("sft", "reward", "ppo", "grpo_verifier", "grpo_learned"):
        assert read_json(workflow / f"outputs/learning/{check}/resume-check.json")["status"] == (
            "PASS")
    assert not list((workflow / "assets/grpo").glob("*"))  # the engine's scratch folders go
    for stage in ("prepare", "base_model", *sorted(WARMSTART | PPO | GRPO | JUDGING)):
        manifest = read_json(workflow / f"outputs/manifests/{stage}.json")
        assert manifest["hashed"]["code_sha256"] and manifest["run"]["wall_seconds"] >= 0
        assert (workflow / f"outputs/benchmarks/{stage}.tsv").is_file()
        assert (workflow / f"logs/{stage}.log").is_file()
    curve = read_json(workflow / "outputs/base-model.json")["learning_curve"]
    assert len(curve) == 20


def declared_inputs(workdir: Path) -> dict[str, list[str]]:
    """Every rule's declared inputs, from a forced dry run of the whole DAG."""
    out = run(workdir, "-n", "-F").stdout
    found = re.findall(r"^(?:local)?rule (\w+):\n(?:    input: (.*)\n)?", out, flags=re.M)
    return {rule: inputs.split(", ") if inputs else [] for rule, inputs in found}


def test_manifests_record_what_each_stage_read_and_its_rule_declares(workflow):
    """A manifest's inputs are the files its stage opened; each must be one its rule declares
    (or lies in a declared folder, or is a corpus or model file behind the declared prepare or
    base_model manifest), or Snakemake could run the stage before that file exists."""
    model = configuration.load(workflow / "configs/ci.yaml")["model"]["path"]
    for rule, inputs in declared_inputs(workflow).items():
        if rule == "all":
            continue
        recorded = read_json(workflow / f"outputs/manifests/{rule}.json")["hashed"]["inputs"]
        assert recorded or rule in ("prepare", "base_model"), f"{rule} recorded no input"
        covered = [*inputs]
        if "outputs/manifests/prepare.json" in inputs:
            covered.append("data/generated")
        if "outputs/manifests/base_model.json" in inputs:
            covered.append(model)
        for path in recorded:
            assert any(path == c or path.startswith(c.rstrip("/") + "/") for c in covered), (
                f"{rule} read {path}, which its rule does not declare")


def test_ppo_rollouts_let_anyone_recompute_the_targets(workflow):
    import torch

    from reprorl.model import losses

    report = read_json(workflow / "outputs/learning/ppo/continuous.json")
    assert report["iterations"] == 100 and report["updates_per_optimizer"] == 200
    assert report["reference_and_reward_unchanged"]
    ids = [i for entry in report["history"] for i in entry["rollout_ids"]]
    assert len(ids) == len(set(ids)) == 400
    resumed = sorted((workflow / "outputs/learning/rollouts/resume").glob("*.json"))
    assert len(resumed) == 60 and resumed[0].name == "iteration-041.json"
    for rollout in read_json(workflow / "outputs/learning/rollouts/continuous/"
                                        "iteration-001.json")["rollouts"]:
        n = len(rollout["response_ids"])
        mask = torch.ones(1, n, dtype=torch.bool)
        rewards = losses.token_rewards(
            torch.tensor([rollout["behaviour_logprobs"]]),
            torch.tensor([rollout["reference_logprobs"]]), mask,
            torch.tensor([rollout["reward_model_score"]]),
            torch.tensor([rollout["finish_reason"] == "cut"]))
        advantages, returns = losses.gae(rewards, torch.tensor([rollout["values"]]), mask)
        torch.testing.assert_close(rewards[0].tolist(), rollout["rewards"])
        torch.testing.assert_close(advantages[0].tolist(), rollout["advantages"])
        torch.testing.assert_close(returns[0].tolist(), rollout["returns"])
    rubric = read_json(workflow / "outputs/learning/ppo/rollout-rubric.json")
    assert len(rubric["iterations"]) == 100 and set(rubric["first_10"]) >= {"rubric_success_rate"}


def test_results_fit_their_schema_and_invariants(workflow):
    from reprorl.pipeline.evaluate import validate_results

    results = read_json(workflow / "outputs/results.json")
    validate_results(results)
    assert results["learned_score_name"] == "predicted simulated preference"
    assert {c["status"] for c in results["resume_checks"].values()} == {"PASS"}
    assert set(results["policies"]) == {"sft", "ppo", "grpo_verifier", "grpo_learned"}
    for policy in results["policies"]:
        metrics = results["policies"][policy]["metrics"]
        assert [metrics[p]["rows"] for p in ("test_rows", "probe_rows", "probe_unique_contexts",
                                            "all_rows", "all_unique_contexts")] == [
            180, 80, 20, 260, 200]
    table = (workflow / "outputs/results.md").read_text()
    assert "no human study" in table and "predicted simulated preference" in table
    assert len(list((workflow / "outputs/report").glob("*.png"))) == len(FIGURES)
    assert "## GRPO training" in table
    record = results["training_record"]
    assert record["data_audit"]["pairs_by_split"] == {"train": 840, "validation": 180,
                                                      "test": 180}
    ppo = read_json(workflow / "outputs/learning/ppo/continuous.json")
    assert record["ppo_rescoring_gap"]["before_first_update"] == ppo["history"][0][
        "rescoring_gap"]
    assert record["checkpoint_bytes"]["final_exports"]["ppo"] == (
        workflow / "assets/checkpoints/ppo-final.safetensors").stat().st_size
    assert [v["epoch"] for v in record["validation_per_epoch"]["reward"]] == [1, 2]
    assert "## Training record" in table and "reprorl costs" in table
    curves = results["over_optimisation"]["runs"]
    start = read_json(workflow / "outputs/learning/sft/validation-greedy.json")
    for branch, points in curves.items():
        assert points[0]["rubric_success_rate"] == start["rubric_success_rate"]
        assert points[0]["sampled_logratio"] == 0.0
        folder = workflow / f"assets/checkpoints/{branch}-snapshots"
        kept = sorted(int(p.name.removeprefix("step-")) for p in folder.glob("step-*"))
        assert [p["step"] for p in points[1:]] == kept
        planned = read_json(folder / "plan.json")["planned"]  # the CI verifier run may take 0
        assert [p["fraction"] for p in points[1:]] == [step / planned for step in kept]
    assert [p["step"] for p in curves["ppo"]] == [0, 25, 50, 75, 100]  # kept every 25
    assert "## Over-optimisation" in table


def test_costs_lists_every_stage_from_its_manifest(workflow):
    result = reprorl(workflow, "costs", check=True)
    stages = json.loads(result.stdout)
    manifest = read_json(workflow / "outputs/manifests/ppo_continuous.json")["run"]
    assert stages["ppo_continuous"]["phase_seconds"] == manifest["phase_seconds"]
    assert stages["ppo_continuous"]["cpu_seconds"] == manifest["cpu_seconds"] > 0
    assert {"base_model", "evaluate", "report"} <= set(stages)


def test_exercise_left_every_hash_unchanged(workflow):
    exercise = read_json(workflow / "outputs/exercise/reward-shortcuts.json")
    assert exercise["contexts"] == 20 and exercise["probe_rows"] == 80 and not exercise["refit"]
    for path, digest in exercise["hashes_unchanged"].items():
        assert sha256_file(workflow / path) == digest, path


def test_evaluation_refuses_tampered_generations_and_failed_checks(workflow):
    generations = workflow / "outputs/inference/ppo.json"
    check = workflow / "outputs/learning/ppo/resume-check.json"
    originals = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (generations, check)}
    try:
        content = read_json(generations)
        probes = [r for r in content["rows"] if r["page"]["split"] == "probe"]
        probes[1]["generation"]["text"] += " tampered"
        write_json(generations, content)
        result = reprorl(workflow, "evaluate", "--config", "configs/ci.yaml")
        assert result.returncode == 2 and "with the same prompt differ" in result.stderr
        generations.write_bytes(originals[generations][0])
        check.write_text(check.read_text().replace('"PASS"', '"FAIL"'))
        result = reprorl(workflow, "evaluate", "--config", "configs/ci.yaml")
        assert result.returncode == 2 and "says FAIL" in result.stderr
        check.unlink()
        result = reprorl(workflow, "evaluate", "--config", "configs/ci.yaml")
        assert result.returncode == 2 and "resume-check.json is missing" in result.stderr
    finally:  # restore bytes and times, so Snakemake sees nothing to redo
        for path, (data, mtime) in originals.items():
            path.write_bytes(data)
            os.utime(path, ns=(mtime, mtime))


def test_generation_refuses_to_run_where_labels_are_visible(workflow):
    result = reprorl(workflow, "generate_sft", "--config", "configs/ci.yaml")
    assert result.returncode == 2 and "generation can see" in result.stderr


def test_noop_rerun_plans_nothing(workflow):
    out = run(workflow).stdout + run(workflow, "-n").stdout
    assert "Nothing to be done" in out


def test_snakemake_report_carries_the_results(workflow, tmp_path):
    """`snakemake --report` holds the results table, the rows CSV, the exercise, the resume
    checks and every figure, each under its caption and category."""
    archive = tmp_path / "report.zip"
    run(workflow, "--report", str(archive))
    with zipfile.ZipFile(archive) as bundle:
        names = bundle.namelist()
        text = "\n".join(bundle.read(name).decode("utf-8", "replace") for name in names
                          if name.endswith((".html", ".js")))
    reported = ["results.md", "results-rows.csv", "reward-shortcuts.json", "resume-check.json",
                *(f"{figure}.png" for figure in FIGURES)]
    for name in reported:
        assert any(entry.endswith(name) for entry in names), name
    results_md = (workflow / "outputs/results.md").read_bytes()
    assert any(bundle_bytes == results_md for bundle_bytes in _members(archive, "results.md"))
    for category in ("5. Results", "6. Politeness exercise", "7. Reproducibility", "3. PPO"):
        assert category in text, category
    assert "bootstrap interval over prompts" in text  # a caption, rendered


def _members(archive: Path, suffix: str) -> list[bytes]:
    with zipfile.ZipFile(archive) as bundle:
        return [bundle.read(name) for name in bundle.namelist() if name.endswith(suffix)]


def test_audit_target_passes(workflow):
    run(workflow, "audit")
    assert '"status": "PASS"' in (workflow / "logs/audit.log").read_text()


@pytest.mark.parametrize(
    "module, expected",
    [
        # the objectives of SFT, the reward model and PPO: everything they start
        ("model/losses.py", WARMSTART | PPO | GRPO | JUDGING),
        ("pipeline/ppo.py", PPO | JUDGING - {"generate_sft", "reward_test"}),
        ("pipeline/report.py", {"report"}),
        ("pipeline/evaluate.py", {"reward_test", "evaluate", "exercise", "report"}),
        # the measurement only: the snapshots it reads come from pipeline/snapshots.py
        ("pipeline/curves.py", {"sft_validation", "curve_ppo", "curve_grpo_verifier",
                                "curve_grpo_learned", "evaluate", "report"}),
        # PPO and GRPO start from the warm start
        ("pipeline/warmstart.py", WARMSTART | PPO | GRPO | JUDGING),
        ("pipeline/base_model.py", {"base_model"} | WARMSTART | PPO | GRPO | JUDGING),
        ("pipeline/rubric.py", {"prepare", "base_model", "generation_inputs"} | WARMSTART | PPO
         | GRPO | JUDGING),
        ("model/grpo_losses.py", GRPO | {"evaluate", "exercise", "report"}),
        ("cli.py", set()),
    ],
)
def test_code_edit_reruns_exactly_the_dependents(workflow, module, expected):
    path = workflow / "src/reprorl" / module
    original = path.read_text()
    try:
        path.write_text(original + "\n# an edit\n")
        assert planned_rules(workflow) == expected
    finally:
        path.write_text(original)
    assert planned_rules(workflow) == set()


@pytest.mark.parametrize(
    "rule, expected",
    [
        # the exercise reads the final checkpoints (the resume's), not the continuous run's
        ("ppo_continuous", {"ppo_continuous", "ppo_resume_check", "ppo_report", "curve_ppo",
                            "evaluate", "report"}),
        ("grpo_verifier_resume", {"grpo_verifier_resume", "grpo_verifier_resume_check",
                                  "generate_grpo_verifier", "evaluate", "exercise", "report"}),
        ("report", {"report"}),
    ],
)
def test_forcerun_reruns_the_rule_and_exactly_its_dependents(workflow, rule, expected):
    assert planned_rules(workflow, "--forcerun", rule) == expected


def test_config_edit_reruns_only_its_stage(workflow):
    # pretrain_threads, checkpoint_every: not a result
    assert planned_rules(workflow, "--config", "pretrain_threads=1") == set()
    assert planned_rules(workflow, "--config", "checkpoint_every=5") == set()
    changed = planned_rules(workflow, "--config", "seed=49", "profile=other")
    assert changed == set()


def test_a_second_clean_run_gives_identical_manifests(workflow, tmp_path):
    """The whole default DAG once more, from an empty folder elsewhere: every stage manifest's
    hashed section (output and input hashes, summaries, code, config, libraries) equals the
    first run's; only the run sections (timings, host) differ. Async GRPO included."""
    again = copy_workflow(tmp_path / "again")
    run(again)
    second = {p.name: read_json(p)["hashed"] for p in (again / "outputs/manifests").glob("*")}
    # every stage but the audit and the seeds summary (not in the default target)
    assert len(second) == len(STAGES) - 2, sorted(second)
    for name, hashed in sorted(second.items()):
        first = read_json(workflow / "outputs/manifests" / name)["hashed"]
        differing = sorted(k for k in first.keys() | hashed.keys()
                           if first.get(k) != hashed.get(k))
        assert not differing, f"{name}: {differing} differ between two clean runs"


def test_a_seed_run_reuses_the_corpus_and_base_and_rebuilds_the_rest(workflow):
    """`reprorl seed-run` (the seeds target's step) on the CI profile, as a dry run of its
    nested Snakemake: the corpus and base model copied in count as built, every learning
    stage's straight run and everything after it is to run, no interrupted or resumed run,
    no resume check (the main run's prove resumption) and no curve (a five-seed run is in
    benchmarks/RESULTS.md)."""
    ci = json.dumps(configuration.load(str(workflow / "configs/ci.yaml")))
    result = reprorl(workflow, "seed-run", "50", "--config-json", ci, "--cores", "2",
                     "--dry-run", check=True)
    planned = set(re.findall(r"^(?:local)?rule (\w+):", result.stdout, flags=re.M))
    triples = {f"{branch}_{mode}" for branch in EXPORTS
               for mode in ("interrupt", "resume", "resume_check")}
    curves = {f"curve_{branch}" for branch in CURVES}
    assert planned == set(STAGES) - {"prepare", "base_model", "audit", "seeds", "report"} - (
        triples) - curves
    work = workflow / "outputs/seeds/50"
    assert sha256_file(work / "data/generated/manifest.json") == sha256_file(
        workflow / "data/generated/manifest.json")
    assert read_json(work / "seed-config.json")["ppo"]["generation_seed"] == 250


def test_tampered_corpus_is_named_and_kept(workflow):
    target = workflow / "data/generated/labels/gold.json"
    original = target.read_bytes()
    try:
        target.write_bytes(original.replace(b'"chosen"', b'"chosen" ', 1))
        tampered = sha256_file(target)
        result = run(workflow, "audit", check=False)
        assert result.returncode != 0
        audit_log = (workflow / "logs/audit.log").read_text()
        assert "data/generated/labels/gold.json differs" in audit_log
        # a forced prepare refuses, names the file, and overwrites nothing
        result = run(workflow, "prepare", "--forcerun", "prepare", check=False)
        assert result.returncode != 0
        log = (workflow / "logs/prepare.log").read_text()
        assert "data/generated/labels/gold.json is not what this code generates" in log
        assert sha256_file(target) == tampered
    finally:
        target.write_bytes(original)
    run(workflow, "prepare", "--forcerun", "prepare")  # identical corpus: kept
    run(workflow, "audit")


@pytest.mark.parametrize(
    "args, message",
    [
        (("--config", "pretrain_threads=two"),
         "config key pretrain_threads: 'two' is not of type 'integer'"),
        (("--config", "modle={}"), "Additional properties are not allowed ('modle'"),
    ],
)
def test_schema_errors_are_one_clear_message(workflow, args, message):
    result = run(workflow, "-n", *args, check=False)
    assert result.returncode != 0 and message in result.stdout + result.stderr


def test_snakemake_refuses_a_non_finite_number_in_a_configfile(workflow):
    """Snakemake parses --configfile itself (YAML .nan is a float): validate must see it."""
    profile = workflow / "configs/nan.yaml"
    profile.write_text(PROFILES["configs/nan.yaml"])
    try:
        result = snakemake(workflow, "-n", "--configfile", "configs/ci.yaml", "configs/nan.yaml",
                           check=False)
    finally:
        profile.unlink()
    assert result.returncode != 0
    message = "config key sft.learning_rate: nan is not a finite number"
    assert message in result.stdout + result.stderr


def test_cli_runs_a_stage_from_a_profile(workflow):
    result = reprorl(workflow, "prepare", "--config", "configs/ci.yaml")
    assert result.returncode == 0, result.stderr  # identical corpus: kept, manifest rewritten
    result = reprorl(workflow, "base_model", "--config", "configs/nope.yaml")
    assert result.returncode == 2 and "does not exist" in result.stderr


def _snapshot(workdir: Path) -> dict[str, str]:
    return {str(p.relative_to(workdir)): sha256_file(p)
            for top in ("data", "assets", "outputs") for p in (workdir / top).rglob("*")
            if p.is_file() and ".snakemake" not in p.parts}


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _leak_probe(workdir: Path, name: str) -> None:
    """A generator bug, simulated: a probe row lands in a learning file, and the corpus
    manifest is re-signed to vouch for it (only the held-out check can still see it)."""
    corpus = workdir / "data/generated"
    probe = next(r for r in read_json(corpus / "input/pages.json") if r["split"] == "probe")
    rows = read_json(corpus / name)
    rows.append({**rows[0], "document_id": probe["document_id"], "prompt": probe["prompt"]})
    write_json(corpus / name, rows)
    manifest = read_json(corpus / "manifest.json")
    manifest["files"][name] = sha256_file(corpus / name)
    write_json(corpus / "manifest.json", manifest)


# profiles a case adds under configs/ (removed afterwards)
PROFILES = {
    "configs/broken.yaml": "profile: broken\nsft:\n  learning_rate: [0.003\n",
    "configs/nan.yaml": "profile: nan\nsft:\n  learning_rate: .nan\n",
}
# what a resume state may hold instead of one: a valid gzip of a pickle weights_only refuses
# (a class), or of bytes that are no pickle at all
FOREIGN_STATES = {
    "pickle": gzip.compress(pickle.dumps(collections.OrderedDict)),
    "garbage": gzip.compress(bytes(range(256)) * 16),
}
# how a case damages the project before its command runs (undone afterwards, bytes and times;
# a file the case added is removed)
DAMAGES = {
    "flip": lambda workdir, name: _flip_byte(workdir / name),
    "aside": lambda workdir, name: (workdir / name).unlink(),  # the stage's own old output
    "edit": lambda workdir, name: (workdir / name).write_text(
        (workdir / name).read_text() + "\n# an edit\n"),
    "leak": _leak_probe,
    "profile": lambda workdir, name: (workdir / name).write_text(PROFILES[name]),
    "pickle": lambda workdir, name: (workdir / name).write_bytes(FOREIGN_STATES["pickle"]),
    "garbage": lambda workdir, name: (workdir / name).write_bytes(FOREIGN_STATES["garbage"]),
}


def _qwen_on_tiny(workdir: Path) -> dict:
    """The Qwen profile pointed at the tiny embedded base."""
    config = configuration.load(workdir / "configs/qwen2.5-0.5b.yaml")
    config["model"]["path"] = "assets/model"
    return config


def _ci_sft_lr_x2(workdir: Path) -> dict:
    """The CI profile with another SFT learning rate than its interrupt state was made with."""
    config = configuration.load(workdir / "configs/ci.yaml")
    config["sft"]["learning_rate"] *= 2
    return config


def _ci_grpo_lr_x2(workdir: Path) -> dict:
    """The CI profile with another GRPO learning rate than its interrupt state was made with."""
    config = configuration.load(workdir / "configs/ci.yaml")
    config["grpo"]["learning_rate"] *= 2
    return config


def _ci_short_context(workdir: Path) -> dict:
    """The CI profile with a context too short for a full-length prompt and response."""
    config = configuration.load(workdir / "configs/ci.yaml")
    config["limits"]["context_tokens"] = 300
    return config


CONFIG_EDITS = {"QWEN_ON_TINY": _qwen_on_tiny, "CI_SFT_LR_X2": _ci_sft_lr_x2,
                "CI_GRPO_LR_X2": _ci_grpo_lr_x2, "CI_SHORT_CONTEXT": _ci_short_context}

BAD_INPUTS = {
    # case: (damages [(kind, path)], command, expected message)
    "corrupted checkpoint": ([("flip", "assets/checkpoints/reward-final.safetensors")],
                             ["reward_test", "--config", "configs/ci.yaml"],
                             "does not match the sha256"),
    "tampered corpus file": ([("flip", "data/generated/input/pages.json")],
                             ["generation_inputs", "--config", "configs/ci.yaml"],
                             "the corpus was modified"),
    "missing model directory": ([], ["base_model", "--config", "configs/qwen2.5-0.5b.yaml"],
                                "no model at assets/qwen2.5-0.5b-instruct"),
    "wrong-architecture model": ([], ["base_model", "--config-json", "QWEN_ON_TINY"],
                                 "hidden_size=64, the profile expects 896"),
    "invalid config": ([], ["prepare", "--config-json", '{"seed": "49"}'],
                       "config key seed: '49' is not of type 'integer'"),
    "resume state from another config": (
        [("aside", "assets/checkpoints/sft-resume.pt.gz")],
        ["sft_resume", "--config-json", "CI_SFT_LR_X2"],
        "cannot be resumed by this run (identity['config']['sft']['learning_rate']"),
    "resume state from other code": (
        [("edit", "src/reprorl/pipeline/warmstart.py"),
         ("aside", "assets/checkpoints/sft-resume.pt.gz")],
        ["sft_resume", "--config", "configs/ci.yaml"],
        "cannot be resumed by this run (identity['code_sha256']"),
    "overwrite a preserved checkpoint": ([], ["sft_interrupt", "--config", "configs/ci.yaml"],
                                         "checkpoints are preserved"),
    "overwrite a preserved GRPO policy": ([], ["grpo_learned_resume", "--config",
                                               "configs/ci.yaml"], "checkpoints are preserved"),
    "GRPO resume from another config": (
        [("aside", "assets/checkpoints/grpo_learned-resume.pt.gz")],
        ["grpo_learned_resume", "--config-json", "CI_GRPO_LR_X2"],
        "cannot be resumed by this run (identity['grpo']['learning_rate']"),
    "labels visible to generation": ([], ["generate_ppo", "--config", "configs/ci.yaml"],
                                     "generation can see"),
    "probes visible to a learning stage": (
        [("leak", "labels/validation-pairs.json")], ["sft_validation", "--config",
                                                   "configs/ci.yaml"],
        "holds 1 held-out (test or probe) row(s)"),
    "GRPO from a corrupted SFT checkpoint": (
        [("flip", "assets/checkpoints/sft-final.safetensors")],
        ["grpo_verifier_continuous", "--config", "configs/ci.yaml"],
        "does not match the sha256"),
    "GRPO with an invalid group size": ([], ["grpo_learned_interrupt", "--config-json",
                                               '{"grpo": {"num_generations": 1}}'],
                                        "grpo.num_generations"),
    "a device that is not one": ([], ["sft_continuous", "--config-json",
                                      '{"model": {"device": "gpu"}}'],
                                 "config key model.device: 'gpu' does not match"),
    **({} if torch.cuda.is_available() else {"a GPU where torch sees none": (
        [], ["ppo_continuous", "--config-json", '{"model": {"device": "cuda"}}'],
        "config key model.device is 'cuda' but torch sees no CUDA GPU")}),
    "YAML syntax error in a profile": (
        [("profile", "configs/broken.yaml")], ["prepare", "--config", "configs/broken.yaml"],
        "config file configs/broken.yaml is not valid YAML (line 4, column 1: expected ','"),
    "profile with a .nan": ([("profile", "configs/nan.yaml")],
                            ["sft_continuous", "--config", "configs/nan.yaml"],
                            "config key sft.learning_rate: nan is not a finite number"),
    "config JSON that is not JSON": ([], ["prepare", "--config-json", '{"seed": 49'],
                                     "--config-json is not valid JSON (Expecting ','"),
    "config JSON that is a list": ([], ["prepare", "--config-json", '[{"seed": 49}]'],
                                   "--config-json must be a JSON object ({...}), not a list"),
    "config JSON with NaN": ([], ["sft_continuous", "--config-json",
                                  '{"sft": {"learning_rate": NaN}}'],
                             "config key sft.learning_rate: nan is not a finite number"),
    "context shorter than prompt plus response": (
        [], ["generate_sft", "--config-json", "CI_SHORT_CONTEXT"],
        ("config key limits.context_tokens: 300 is less than limits.prompt_tokens + "
         "limits.response_tokens = 256 + 64")),
    "resume state holding a pickled object": (
        [("aside", "assets/checkpoints/reward-resume.pt.gz"),
         ("pickle", "assets/checkpoints/reward-interrupt.pt.gz")],
        ["reward_resume", "--config", "configs/ci.yaml"],
        "reward-interrupt.pt.gz is corrupted (not a weights-only torch file"),
    "resume check of a gzip of garbage": (
        [("garbage", "assets/checkpoints/ppo-continuous.pt.gz")],
        ["ppo_resume_check", "--config", "configs/ci.yaml"],
        "ppo-continuous.pt.gz is corrupted ("),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_refused_cleanly(workflow, case):
    damages, command, message = BAD_INPUTS[case]
    command = [json.dumps(CONFIG_EDITS[c](workflow)) if c in CONFIG_EDITS else c
               for c in command]
    touched = []
    for kind, name in damages:
        touched += [workflow / name] if kind != "leak" else [
            workflow / "data/generated" / name, workflow / "data/generated/manifest.json"]
    saved = {p: (p.read_bytes(), p.stat().st_mtime_ns) if p.exists() else None for p in touched}
    try:
        for kind, name in damages:
            DAMAGES[kind](workflow, name)
        before = _snapshot(workflow)
        result = reprorl(workflow, *command)
        assert result.returncode == 2, result.stdout + result.stderr
        error_lines = [line for line in result.stderr.splitlines() if "error:" in line]
        assert len(error_lines) == 1 and message in error_lines[0], result.stderr
        assert _snapshot(workflow) == before  # nothing produced was lost or overwritten
    finally:
        for path, kept in saved.items():
            if kept is None:  # added by the case (a profile)
                path.unlink(missing_ok=True)
                continue
            path.write_bytes(kept[0])
            os.utime(path, ns=(kept[1], kept[1]))


def test_grpo_stages_run_on_two_trainer_ranks(workflow, tmp_path):
    """`grpo.nproc_per_node: 2` (given as Snakemake users give it, on the command line) reruns
    the learned-reward GRPO branch under torchrun, each job asking for 2 threads, and its
    resume check passes: rank 0 writes the stage's files, the interrupt resumes on 2 ranks."""
    copy = copy_workflow(tmp_path / "wf", origin=workflow,
                         extra=("data", "assets", "outputs", "logs", ".snakemake"))
    target = "outputs/learning/grpo_learned/resume-check.json"
    ranks = ("--config", "grpo={nproc_per_node: 2, ddp_timeout: 617}")
    # (in the full suite the copy may also plan earlier stages that tests before it touched)
    assert planned_rules(copy, target, *ranks) >= {f"grpo_learned_{mode}" for mode in MODES}
    done = run(copy, target, "-p", *ranks)
    out = done.stdout + done.stderr
    launches = re.findall(r"torch\.distributed\.run --standalone --nproc-per-node 2 -m reprorl "
                          r"(grpo_learned_\w+) .* --threads 2 ", out)
    assert sorted(launches) == sorted(f"grpo_learned_{m}" for m in ("interrupt", "continuous",
                                                                     "resume"))
    assert read_json(copy / target)["status"] == "PASS"
    # the profile's timeout is the process group's (grpo_run joins it before the trainer)
    for mode in ("interrupt", "continuous", "resume"):
        log = (copy / f"logs/grpo_learned_{mode}.log").read_text()
        assert "trainer ranks: 2 (gloo, ddp_timeout 617 s)" in log, mode
    report = read_json(copy / "outputs/learning/grpo_learned/continuous.json")
    assert report["steps"] > 0
    manifest = read_json(copy / "outputs/manifests/grpo_learned_resume.json")
    assert manifest["hashed"]["stage"] == "grpo_learned_resume"  # written once, by rank 0
    # its costs count both ranks: the stage's CPU seconds are the sum of the two ranks'
    costs = manifest["run"]["ranks"]
    assert len(costs) == 2 and all(r["cpu_seconds"] > 0 and r["peak_rss_mb"] > 0 for r in costs)
    assert manifest["run"]["cpu_seconds"] == round(sum(r["cpu_seconds"] for r in costs), 3)


def test_ci_profile_has_the_bits_recorded_on_every_cpu_type(workflow):
    """configs/ci.yaml runs portable numerics: its bits must equal those recorded on every CPU
    type so far (one file each, written by `reprorl digests --write` on that machine), as the
    reader's command `reprorl bitcheck` says."""
    recorded = sorted((Path(__file__).parents[1] / "benchmarks/digests").glob("ci-portable-*"))
    assert recorded, "no recorded digests of the CI profile"
    assert read_json(workflow / "outputs/manifests/sft_resume.json")["hashed"]["config"][
        "numerics"] == "portable"
    result = reprorl(workflow, "bitcheck", *map(str, recorded))
    assert result.returncode == 0, (
        f"{result.stdout}{result.stderr}\nIf this change alters the numbers on purpose, write "
        "each CPU type's file again with `reprorl digests --write` on a machine of that type "
        "(docs/reproducibility.md)")
    verdicts = [line for line in result.stdout.splitlines() if line.startswith("same bits as")]
    assert len(verdicts) == len(recorded)  # one verdict line per file, then the JSON report
