# Bradley-Terry reward model: interrupt after epoch 1, resume in a fresh process, run straight through,
# and check that resume and continuous end in bitwise-equal states.


rule reward_interrupt:
    input:
        corpus=rules.prepare.output.manifest,
        model=rules.base_model.output.manifest,
    output:
        **warmstart_output("reward", "interrupt"),
    log:
        "logs/reward_interrupt.log",
    benchmark:
        "outputs/benchmarks/reward_interrupt.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    resources:
        mem_mb=4000,
    params:
        code=code_hash("reward_interrupt"),
        config=stage_config_json(config, "reward_interrupt"),
    shell:
        stage_command("reward_interrupt")


rule reward_continuous:
    input:
        corpus=rules.prepare.output.manifest,
        model=rules.base_model.output.manifest,
    output:
        **warmstart_output("reward", "continuous"),
    log:
        "logs/reward_continuous.log",
    benchmark:
        "outputs/benchmarks/reward_continuous.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    resources:
        mem_mb=4000,
    params:
        code=code_hash("reward_continuous"),
        config=stage_config_json(config, "reward_continuous"),
    shell:
        stage_command("reward_continuous")


rule reward_resume:
    input:
        corpus=rules.prepare.output.manifest,
        model=rules.base_model.output.manifest,
        interrupted=rules.reward_interrupt.output.state,
    output:
        **warmstart_output("reward", "resume"),
    log:
        "logs/reward_resume.log",
    benchmark:
        "outputs/benchmarks/reward_resume.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    resources:
        mem_mb=4000,
    params:
        code=code_hash("reward_resume"),
        config=stage_config_json(config, "reward_resume"),
    shell:
        stage_command("reward_resume")


rule reward_resume_check:
    input:
        continuous=rules.reward_continuous.output.state,
        resumed=rules.reward_resume.output.state,
    output:
        check="outputs/learning/reward/resume-check.json",
        manifest="outputs/manifests/reward_resume_check.json",
    log:
        "logs/reward_resume_check.log",
    benchmark:
        "outputs/benchmarks/reward_resume_check.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    params:
        code=code_hash("reward_resume_check"),
        config=stage_config_json(config, "reward_resume_check"),
    shell:
        stage_command("reward_resume_check")
