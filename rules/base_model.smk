# The embedded base is built by this rule; a local model is only verified by it.
rule base_model:
    output:
        **stage_output("base_model"),
    log:
        layout.log("base_model"),
    benchmark:
        layout.benchmark("base_model")
    priority: stage_priority("base_model")
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: stage_threads("base_model")
    resources:
        **stage_resources("base_model", mem_mb=4000),
    params:
        **stage_params("base_model"),
    shell:
        STAGE_COMMAND
