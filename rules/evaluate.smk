# Judging: the reward model on the test pairs, every policy against the rubric (results), the
# politeness exercise on the fixed probe candidates, and the report.


rule reward_test:
    input:
        corpus=rules.prepare.output.manifest,
        model_manifest=rules.base_model.output.manifest,
        reward=final_checkpoint("reward"),
    output:
        test="outputs/reward-test.json",
        manifest="outputs/manifests/reward_test.json",
    log:
        "logs/reward_test.log",
    benchmark:
        "outputs/benchmarks/reward_test.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    params:
        code=code_hash("reward_test"),
        config=stage_config_json(config, "reward_test"),
    shell:
        stage_command("reward_test")


rule evaluate:
    input:
        corpus=rules.prepare.output.manifest,
        reward_test=rules.reward_test.output.test,
        generations=[
            rules.generate_sft.output.generations,
            rules.generate_ppo.output.generations,
            rules.generate_grpo_verifier.output.generations,
            rules.generate_grpo_learned.output.generations,
        ],
        grpo=[rules.grpo_verifier.output.report, rules.grpo_learned.output.report],
        resume_checks=[
            rules.sft_resume_check.output.check,
            rules.reward_resume_check.output.check,
            rules.ppo_resume_check.output.check,
        ],
        sft_validation=rules.sft_validation.output.report,
        ppo_sampled=rules.ppo_report.output.report,
    output:
        results="outputs/results.json",
        table="outputs/results.md",
        manifest="outputs/manifests/evaluate.json",
    log:
        "logs/evaluate.log",
    benchmark:
        "outputs/benchmarks/evaluate.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    params:
        code=code_hash("evaluate"),
        config=stage_config_json(config, "evaluate"),
    shell:
        stage_command("evaluate")


rule exercise:
    input:
        corpus=rules.prepare.output.manifest,
        model_manifest=rules.base_model.output.manifest,
        reward=final_checkpoint("reward"),
        results=rules.evaluate.output.results,
    output:
        shortcuts="outputs/exercise/reward-shortcuts.json",
        manifest="outputs/manifests/exercise.json",
    log:
        "logs/exercise.log",
    benchmark:
        "outputs/benchmarks/exercise.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    params:
        code=code_hash("exercise"),
        config=stage_config_json(config, "exercise"),
    shell:
        stage_command("exercise")


rule report:
    input:
        base="outputs/base-model.json",
        sft=rules.sft_continuous.output.report,
        reward=rules.reward_continuous.output.report,
        ppo=rules.ppo_report.output.report,
        grpo_verifier=rules.grpo_verifier.output.metrics,
        grpo_learned=rules.grpo_learned.output.metrics,
        results=rules.evaluate.output.results,
        table=rules.evaluate.output.table,
        exercise=rules.exercise.output.shortcuts,
    output:
        figures=expand("outputs/report/{name}.png", name=REPORT_FIGURES),
        page="outputs/report/report.html",
        manifest="outputs/manifests/report.json",
    log:
        "logs/report.log",
    benchmark:
        "outputs/benchmarks/report.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    params:
        code=code_hash("report"),
        config=stage_config_json(config, "report"),
    shell:
        stage_command("report")
