# Over-optimisation curves (reprorl.pipeline.curves): the SFT actor, every curve's start, and
# each snapshot a straight PPO or GRPO run kept answer the 180 validation prompts; the rubric is
# the gold, the frozen reward model the proxy, the sampled log-ratio to SFT the distance.
# Measured, never used to select or stop anything.


rule sft_validation:
    input:
        corpus=rules.prepare.output.manifest,
        model=rules.base_model.output.manifest,
        checkpoints=final_files("sft", "reward"),
    output:
        **stage_output("sft_validation"),
    log:
        layout.log("sft_validation"),
    benchmark:
        layout.benchmark("sft_validation")
    priority: stage_priority("sft_validation")
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: stage_threads("sft_validation")
    resources:
        **stage_resources("sft_validation"),
    params:
        **stage_params("sft_validation"),
    shell:
        STAGE_COMMAND


for branch in CURVES:
    stage = f"curve_{branch}"

    rule:
        name:
            stage
        input:
            corpus=rules.prepare.output.manifest,
            model=rules.base_model.output.manifest,
            snapshots=str(layout.snapshots(branch)),
            # the reference (SFT) for the distance, the reward model for the proxy
            checkpoints=final_files("sft", "reward"),
        output:
            **stage_output(stage),
        log:
            layout.log(stage),
        benchmark:
            layout.benchmark(stage)
        priority: stage_priority(stage)
        conda:
            "../workflow/envs/reprorl.yaml"
        threads: stage_threads(stage)
        resources:
            **stage_resources(stage),
        params:
            **stage_params(stage),
        shell:
            STAGE_COMMAND
