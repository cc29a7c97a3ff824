# PPO: actor and critic learn against the frozen reward model and reference; interrupt at
# iteration 40 of 100, resume in a fresh process, and check the bitwise equality of the ends.


rule ppo_interrupt:
    input:
        corpus=rules.prepare.output.manifest,
        model=rules.base_model.output.manifest,
        sft=rules.sft_resume.output.final,
        reward=rules.reward_resume.output.final,
    output:
        **ppo_output("interrupt"),
    log:
        "logs/ppo_interrupt.log",
    benchmark:
        "outputs/benchmarks/ppo_interrupt.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    resources:
        mem_mb=4000,
    params:
        code=code_hash("ppo_interrupt"),
        config=stage_config_json(config, "ppo_interrupt"),
    shell:
        stage_command("ppo_interrupt")


rule ppo_continuous:
    input:
        corpus=rules.prepare.output.manifest,
        model=rules.base_model.output.manifest,
        sft=rules.sft_resume.output.final,
        reward=rules.reward_resume.output.final,
    output:
        **ppo_output("continuous"),
    log:
        "logs/ppo_continuous.log",
    benchmark:
        "outputs/benchmarks/ppo_continuous.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    resources:
        mem_mb=4000,
    params:
        code=code_hash("ppo_continuous"),
        config=stage_config_json(config, "ppo_continuous"),
    shell:
        stage_command("ppo_continuous")


rule ppo_resume:
    input:
        corpus=rules.prepare.output.manifest,
        model=rules.base_model.output.manifest,
        sft=rules.sft_resume.output.final,
        reward=rules.reward_resume.output.final,
        interrupted=rules.ppo_interrupt.output.state,
    output:
        **ppo_output("resume"),
    log:
        "logs/ppo_resume.log",
    benchmark:
        "outputs/benchmarks/ppo_resume.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    resources:
        mem_mb=4000,
    params:
        code=code_hash("ppo_resume"),
        config=stage_config_json(config, "ppo_resume"),
    shell:
        stage_command("ppo_resume")


rule ppo_resume_check:
    input:
        continuous=rules.ppo_continuous.output.state,
        resumed=rules.ppo_resume.output.state,
    output:
        check="outputs/learning/ppo/resume-check.json",
        manifest="outputs/manifests/ppo_resume_check.json",
    log:
        "logs/ppo_resume_check.log",
    benchmark:
        "outputs/benchmarks/ppo_resume_check.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    params:
        code=code_hash("ppo_resume_check"),
        config=stage_config_json(config, "ppo_resume_check"),
    shell:
        stage_command("ppo_resume_check")


# Rubric success and reward-model score of the responses PPO sampled (first/last 10
# iterations); an evaluation that reads the rollout prompts' situations, never a training input.
rule ppo_report:
    input:
        corpus=rules.prepare.output.manifest,
        rollouts=rules.ppo_continuous.output.rollouts,
    output:
        report="outputs/learning/ppo/rollout-rubric.json",
        manifest="outputs/manifests/ppo_report.json",
    log:
        "logs/ppo_report.log",
    benchmark:
        "outputs/benchmarks/ppo_report.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    params:
        code=code_hash("ppo_report"),
        config=stage_config_json(config, "ppo_report"),
    shell:
        stage_command("ppo_report")
