# Supervised warm start of the actor: interrupt after epoch 1, resume in a fresh process, run straight through,
# and check that resume and continuous end in bitwise-equal states.


rule sft_interrupt:
    input:
        corpus=rules.prepare.output.manifest,
        model=rules.base_model.output.manifest,
    output:
        **warmstart_output("sft", "interrupt"),
    log:
        "logs/sft_interrupt.log",
    benchmark:
        "outputs/benchmarks/sft_interrupt.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    resources:
        mem_mb=4000,
    params:
        code=code_hash("sft_interrupt"),
        config=stage_config_json(config, "sft_interrupt"),
    shell:
        stage_command("sft_interrupt")


rule sft_continuous:
    input:
        corpus=rules.prepare.output.manifest,
        model=rules.base_model.output.manifest,
    output:
        **warmstart_output("sft", "continuous"),
    log:
        "logs/sft_continuous.log",
    benchmark:
        "outputs/benchmarks/sft_continuous.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    resources:
        mem_mb=4000,
    params:
        code=code_hash("sft_continuous"),
        config=stage_config_json(config, "sft_continuous"),
    shell:
        stage_command("sft_continuous")


rule sft_resume:
    input:
        corpus=rules.prepare.output.manifest,
        model=rules.base_model.output.manifest,
        interrupted=rules.sft_interrupt.output.state,
    output:
        **warmstart_output("sft", "resume"),
    log:
        "logs/sft_resume.log",
    benchmark:
        "outputs/benchmarks/sft_resume.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    resources:
        mem_mb=4000,
    params:
        code=code_hash("sft_resume"),
        config=stage_config_json(config, "sft_resume"),
    shell:
        stage_command("sft_resume")


rule sft_resume_check:
    input:
        continuous=rules.sft_continuous.output.state,
        resumed=rules.sft_resume.output.state,
    output:
        check="outputs/learning/sft/resume-check.json",
        manifest="outputs/manifests/sft_resume_check.json",
    log:
        "logs/sft_resume_check.log",
    benchmark:
        "outputs/benchmarks/sft_resume_check.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    params:
        code=code_hash("sft_resume_check"),
        config=stage_config_json(config, "sft_resume_check"),
    shell:
        stage_command("sft_resume_check")


# Greedy rubric success of the final SFT actor on the 180 validation prompts (measured, never
# used to select anything).
rule sft_validation:
    input:
        corpus=rules.prepare.output.manifest,
        actor=rules.sft_resume.output.final,
    output:
        report="outputs/learning/sft/validation-greedy.json",
        manifest="outputs/manifests/sft_validation.json",
    log:
        "logs/sft_validation.log",
    benchmark:
        "outputs/benchmarks/sft_validation.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    params:
        code=code_hash("sft_validation"),
        config=stage_config_json(config, "sft_validation"),
    shell:
        stage_command("sft_validation")
