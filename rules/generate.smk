# Held-out generation. The 260 test+probe rows are cut from the corpus inputs (no labels);
# each policy then answers them in a shadow directory that holds only its declared inputs, so
# it cannot see labels or learning outputs even by mistake.


rule generation_inputs:
    input:
        corpus=rules.prepare.output.manifest,
    output:
        **stage_output("generation_inputs"),
    log:
        layout.log("generation_inputs"),
    benchmark:
        layout.benchmark("generation_inputs")
    priority: stage_priority("generation_inputs")
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: stage_threads("generation_inputs")
    params:
        **stage_params("generation_inputs"),
    shell:
        STAGE_COMMAND


for policy in POLICIES:
    stage = f"generate_{policy}"

    rule:
        name:
            stage
        input:
            pages=rules.generation_inputs.output.pages,
            model=config["model"]["path"],
            model_manifest=rules.base_model.output.manifest,
            # the policy, the reference (SFT) for log-ratios and the reward model for scores
            checkpoints=final_files(policy, "sft", "reward"),
        output:
            **stage_output(stage),
        log:
            layout.log(stage),
        benchmark:
            layout.benchmark(stage)
        priority: stage_priority(stage)
        shadow:
            "minimal"
        conda:
            "../workflow/envs/reprorl.yaml"
        threads: stage_threads(stage)
        resources:
            **stage_resources(stage),
        params:
            **stage_params(stage),
        shell:
            STAGE_COMMAND
