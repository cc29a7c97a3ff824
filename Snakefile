# reprorl: config validation, one include per stage, and the targets.
# Run:   snakemake --cores all                       (embedded default, configs/default.yaml)
#        snakemake --cores all --configfile configs/ci.yaml
from snakemake.utils import min_version

min_version("9.0")


configfile: "configs/default.yaml"


report: "workflow/report/workflow.rst"


include: "rules/common.smk"
include: "rules/data.smk"
include: "rules/base_model.smk"
include: "rules/training.smk"
include: "rules/curves.smk"
include: "rules/generate.smk"
include: "rules/evaluate.smk"
include: "rules/audit.smk"
include: "rules/seeds.smk"


rule all:
    default_target: True
    input:
        rules.prepare.output,
        rules.base_model.output,
        [
            str(layout.resume_check(branch))
            for branch in EXPORTS
            if config["resume_triples"]
        ],
        rules.sft_validation.output,
        rules.ppo_report.output,
        rules.evaluate.output,
        rules.exercise.output,
        rules.report.output,
