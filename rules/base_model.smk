rule base_model:
    output:
        **base_model_output(),
    log:
        "logs/base_model.log",
    benchmark:
        "outputs/benchmarks/base_model.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: config["threads"]
    resources:
        mem_mb=4000,
    params:
        code=code_hash("base_model"),
        config=stage_config_json(config, "base_model"),
    shell:
        stage_command("base_model")
