# Judging: the reward model on the test pairs, the politeness exercise on the fixed probe
# candidates, every policy against the rubric with the exercise beside it (results), the report.


rule reward_test:
    input:
        corpus=rules.prepare.output.manifest,
        model_manifest=rules.base_model.output.manifest,
        reward=final_files("reward"),
    output:
        **stage_output("reward_test"),
    log:
        layout.log("reward_test"),
    benchmark:
        layout.benchmark("reward_test")
    priority: stage_priority("reward_test")
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: stage_threads("reward_test")
    resources:
        **stage_resources("reward_test"),
    params:
        **stage_params("reward_test"),
    shell:
        STAGE_COMMAND


rule exercise:
    input:
        corpus=rules.prepare.output.manifest,
        model_manifest=rules.base_model.output.manifest,
        reward=final_files("reward"),
        # hashed before and after: the exercise must leave them as it found them
        finals=final_files(*(name for names in EXPORTS.values() for name in names)),
        reward_test=rules.reward_test.output.test,
        pages=rules.generation_inputs.output.pages,
        generations=[str(layout.generations(policy)) for policy in POLICIES],
    output:
        **stage_output("exercise"),
    log:
        layout.log("exercise"),
    benchmark:
        layout.benchmark("exercise")
    priority: stage_priority("exercise")
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: stage_threads("exercise")
    resources:
        **stage_resources("exercise"),
    params:
        **stage_params("exercise"),
    shell:
        STAGE_COMMAND


rule evaluate:
    input:
        corpus=rules.prepare.output.manifest,
        reward_test=rules.reward_test.output.test,
        generations=[str(layout.generations(policy)) for policy in POLICIES],
        grpo=[
            str(layout.learning_report(f"grpo_{run}", "continuous"))
            for run in GRPO_RUNS
        ],
        resume_checks=[
            str(layout.resume_check(branch))
            for branch in EXPORTS
            if config["resume_triples"]
        ],
        sft_validation=rules.sft_validation.output.report,
        curves=[
            str(layout.curve(branch))
            for branch in CURVES
            if stage_runs(f"curve_{branch}", config)
        ],
        ppo_sampled=rules.ppo_report.output.report,
        exercise=rules.exercise.output.shortcuts,
        # the training record: audit counts, validation per epoch, PPO's re-scoring gap, sizes
        audit=rules.prepare.output.audit,
        learning=[
            str(layout.learning_report(branch, "continuous"))
            for branch in ("sft", "reward", "ppo")
        ],
        finals=[str(layout.final(name)) for names in EXPORTS.values() for name in names],
    output:
        **stage_output("evaluate"),
    log:
        layout.log("evaluate"),
    benchmark:
        layout.benchmark("evaluate")
    priority: stage_priority("evaluate")
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: stage_threads("evaluate")
    params:
        **stage_params("evaluate"),
    shell:
        STAGE_COMMAND


rule report:
    input:
        base=rules.base_model.output.summary,
        sft=rules.sft_continuous.output.report,
        reward=rules.reward_continuous.output.report,
        ppo=rules.ppo_report.output.report,
        grpo=[
            str(layout.learning_report(f"grpo_{run}", "continuous"))
            for run in GRPO_RUNS
        ],
        results=rules.evaluate.output.results,
        table=rules.evaluate.output.table,
        exercise=rules.exercise.output.shortcuts,
    output:
        **stage_output("report"),
    log:
        layout.log("report"),
    benchmark:
        layout.benchmark("report")
    priority: stage_priority("report")
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: stage_threads("report")
    params:
        **stage_params("report"),
    shell:
        STAGE_COMMAND
