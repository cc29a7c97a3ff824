rule prepare:
    # The corpus files under data/generated are deliberately not declared: Snakemake deletes a
    # job's declared outputs before re-running it, and the corpus is preserved. The manifest
    # lists every corpus file with its sha256; downstream rules depend on it and their stages
    # verify each corpus file they read against it.
    output:
        **stage_output("prepare"),
    log:
        layout.log("prepare"),
    benchmark:
        layout.benchmark("prepare")
    priority: stage_priority("prepare")
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: stage_threads("prepare")
    params:
        **stage_params("prepare"),
    shell:
        STAGE_COMMAND
