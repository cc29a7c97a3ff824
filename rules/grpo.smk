# Async GRPO from the SFT actor on the 672 rollout prompts: the trainer, a spawned rollout
# worker and the embedded generation server run side by side (threads: 2 gives them the
# cores). (a) the rubric as an exact verifier on the train families, (b) the frozen learned
# reward model. Both policies then face the same held-out generation as SFT and PPO.


rule grpo_verifier:
    input:
        corpus=rules.prepare.output.manifest,
        model=rules.base_model.output.manifest,
        sft=rules.sft_resume.output.final,
    output:
        **grpo_output("verifier"),
    log:
        "logs/grpo_verifier.log",
    benchmark:
        "outputs/benchmarks/grpo_verifier.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 2
    resources:
        mem_mb=6000,
    params:
        code=code_hash("grpo_verifier"),
        config=stage_config_json(config, "grpo_verifier"),
    shell:
        stage_command("grpo_verifier")


rule grpo_learned:
    input:
        corpus=rules.prepare.output.manifest,
        model=rules.base_model.output.manifest,
        sft=rules.sft_resume.output.final,
        reward=rules.reward_resume.output.final,
    output:
        **grpo_output("learned"),
    log:
        "logs/grpo_learned.log",
    benchmark:
        "outputs/benchmarks/grpo_learned.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 2
    resources:
        mem_mb=6000,
    params:
        code=code_hash("grpo_learned"),
        config=stage_config_json(config, "grpo_learned"),
    shell:
        stage_command("grpo_learned")
