"""Where every artifact lives: the one module that names a path.

The stage registry (`stages.py`) declares each stage's outputs from these names, and the
stages read and write through the same names, so a path is spelled once. Paths are relative to
the working directory: the workflow root, or the shadow directory a generation job runs in.
"""

from __future__ import annotations

from pathlib import Path
from string import Formatter

# folders
CORPUS = Path("data/generated")
CHECKPOINTS = Path("assets/checkpoints")
GRPO_SCRATCH = Path("assets/grpo")  # the GRPO engine's scratch output_dir (per run, mode)
STAGE_SCRATCH = Path("assets/scratch")  # in-rule checkpoints (`preempt.py`), per stage
OUTPUTS = Path("outputs")
MANIFESTS = OUTPUTS / "manifests"
LEARNING = OUTPUTS / "learning"
INFERENCE = OUTPUTS / "inference"
REPORT = OUTPUTS / "report"
BENCHMARKS = OUTPUTS / "benchmarks"
LOGS = Path("logs")


def numbered(parent: Path, prefix: str) -> list[Path]:
    """The folders in `parent` named `prefix` and then a step (checkpoints, snapshots), in step
    order; another name with that prefix (a user's `checkpoint-3-old` copy) is not one."""
    return sorted((path for path in parent.glob(f"{prefix}*")
                   if path.name.removeprefix(prefix).isdigit()),
                  key=lambda path: int(path.name.removeprefix(prefix)))


class Pattern(str):
    """A path with {wildcards}, as in a Snakemake rule; called with their values in order."""

    def __new__(cls, path: Path) -> Pattern:
        return super().__new__(cls, path.as_posix())

    def __call__(self, *values: str) -> Path:
        names = [field for _, field, _, _ in Formatter().parse(self) if field]
        if len(values) != len(names):
            raise TypeError(f"{self} takes {len(names)} value(s) ({', '.join(names)})")
        return Path(self.format(**dict(zip(names, values))))


# single files
CORPUS_MANIFEST = CORPUS / "manifest.json"
DATA_AUDIT = OUTPUTS / "data-audit.json"
BASE_MODEL_SUMMARY = OUTPUTS / "base-model.json"
SFT_VALIDATION = LEARNING / "sft/validation-greedy.json"
PPO_SAMPLED = LEARNING / "ppo/rollout-rubric.json"
GENERATION_PAGES = INFERENCE / "pages.json"
REWARD_TEST = OUTPUTS / "reward-test.json"
RESULTS = OUTPUTS / "results.json"
RESULTS_TABLE = OUTPUTS / "results.md"
RESULTS_ROWS = OUTPUTS / "results-rows.csv"  # every judged row of every policy
EXERCISE = OUTPUTS / "exercise/reward-shortcuts.json"
REPORT_PAGE = REPORT / "report.html"
SEEDS_SUMMARY = OUTPUTS / "seeds/summary.json"
# the digests of the run the README's results block came from (`reprorl bitcheck` reads them)
README_DIGESTS = Path("benchmarks/digests/readme.json")
FIGURES = ("pretraining", "warmstart", "ppo", "grpo", "policies", "curves", "probes")
# what a generation job must not see: labels, learning outputs and judgements
HIDDEN_FROM_GENERATION = (CORPUS / "labels", CORPUS_MANIFEST, LEARNING, GRPO_SCRATCH,
                          STAGE_SCRATCH, REWARD_TEST, RESULTS, EXERCISE.parent)
# output names that are folders (the rules declare them with directory())
DIRECTORIES = frozenset({"model", "rollouts", "peft", "snapshots"})


# files per stage, training branch, run or policy: call with the wildcards' values
# every stage
manifest = Pattern(MANIFESTS / "{stage}.json")
log = Pattern(LOGS / "{stage}.log")
# a GRPO stage's metrics windows with their timings (the learning report keeps the rest)
metrics_log = Pattern(LOGS / "{stage}-metrics.jsonl")
# a GRPO stage's TensorBoard event files, with grpo.report_to: tensorboard
tensorboard_dir = Pattern(LOGS / "tensorboard/{stage}")
benchmark = Pattern(BENCHMARKS / "{stage}.tsv")
# the resumable training branches (sft, reward, ppo, grpo_<run>) in their modes
state = Pattern(CHECKPOINTS / "{branch}-{mode}.pt.gz")
learning_report = Pattern(LEARNING / "{branch}/{mode}.json")
resume_check = Pattern(LEARNING / "{branch}/resume-check.json")
rollouts = Pattern(LEARNING / "rollouts/{mode}")  # PPO's samples, a file per iteration
# a straight run's actor at fixed points (PEFT folders), and the curve measured from them
snapshots = Pattern(CHECKPOINTS / "{branch}-snapshots")
curve = Pattern(OUTPUTS / "curves/{branch}.json")
# a trained role's final export: learned tensors, the JSON with their sha256 and identity,
# and for an actor the same adapters in PEFT format (for `peft` and vLLM)
final = Pattern(CHECKPOINTS / "{name}-final.safetensors")
final_manifest = Pattern(CHECKPOINTS / "{name}-final.json")
peft = Pattern(CHECKPOINTS / "{name}-peft")


def final_files(name: str) -> list[Path]:
    return [final(name), final_manifest(name)]


# the async GRPO engine's output_dir (checkpoint-*/, metrics.jsonl), a scratch folder: the
# stage keeps its final checkpoint in the branch's state and removes it
grpo_output_dir = Pattern(GRPO_SCRATCH / "{branch}-{mode}.tmp")
# a training stage's in-rule checkpoints (`preempt.py`), keyed by a hash of its identity
stage_scratch = Pattern(STAGE_SCRATCH / "{stage}-{key}")
# a seed's nested run of the main results (`seeds.py`): its own working directory
seed_dir = Pattern(OUTPUTS / "seeds/{seed}")
# judging
generations = Pattern(INFERENCE / "{policy}.json")
figure = Pattern(REPORT / "{name}.png")
