# Held-out generation. The 260 test+probe rows are cut from the corpus inputs (no labels);
# each policy then answers them in a shadow directory that holds only its declared inputs, so
# it cannot see labels or learning outputs even by mistake.


rule generation_inputs:
    input:
        corpus=rules.prepare.output.manifest,
    output:
        pages="outputs/inference/pages.json",
        manifest="outputs/manifests/generation_inputs.json",
    log:
        "logs/generation_inputs.log",
    benchmark:
        "outputs/benchmarks/generation_inputs.tsv"
    conda:
        "../workflow/envs/reprorl.yaml"
    params:
        code=code_hash("generation_inputs"),
        config=stage_config_json(config, "generation_inputs"),
    shell:
        stage_command("generation_inputs")


rule generate_sft:
    input:
        pages=rules.generation_inputs.output.pages,
        model=config["model"]["path"],
        model_manifest=rules.base_model.output.manifest,
        actor=final_checkpoint("sft"),
        reward=final_checkpoint("reward"),
    output:
        generations="outputs/inference/sft.json",
        manifest="outputs/manifests/generate_sft.json",
    log:
        "logs/generate_sft.log",
    benchmark:
        "outputs/benchmarks/generate_sft.tsv"
    shadow:
        "minimal"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    params:
        code=code_hash("generate_sft"),
        config=stage_config_json(config, "generate_sft"),
    shell:
        stage_command("generate_sft")


rule generate_ppo:
    input:
        pages=rules.generation_inputs.output.pages,
        model=config["model"]["path"],
        model_manifest=rules.base_model.output.manifest,
        actor=final_checkpoint("ppo"),
        reference=final_checkpoint("sft"),
        reward=final_checkpoint("reward"),
    output:
        generations="outputs/inference/ppo.json",
        manifest="outputs/manifests/generate_ppo.json",
    log:
        "logs/generate_ppo.log",
    benchmark:
        "outputs/benchmarks/generate_ppo.tsv"
    shadow:
        "minimal"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    params:
        code=code_hash("generate_ppo"),
        config=stage_config_json(config, "generate_ppo"),
    shell:
        stage_command("generate_ppo")


rule generate_grpo_verifier:
    input:
        pages=rules.generation_inputs.output.pages,
        model=config["model"]["path"],
        model_manifest=rules.base_model.output.manifest,
        actor=final_checkpoint("grpo_verifier"),
        reference=final_checkpoint("sft"),
        reward=final_checkpoint("reward"),
    output:
        generations="outputs/inference/grpo_verifier.json",
        manifest="outputs/manifests/generate_grpo_verifier.json",
    log:
        "logs/generate_grpo_verifier.log",
    benchmark:
        "outputs/benchmarks/generate_grpo_verifier.tsv"
    shadow:
        "minimal"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    params:
        code=code_hash("generate_grpo_verifier"),
        config=stage_config_json(config, "generate_grpo_verifier"),
    shell:
        stage_command("generate_grpo_verifier")


rule generate_grpo_learned:
    input:
        pages=rules.generation_inputs.output.pages,
        model=config["model"]["path"],
        model_manifest=rules.base_model.output.manifest,
        actor=final_checkpoint("grpo_learned"),
        reference=final_checkpoint("sft"),
        reward=final_checkpoint("reward"),
    output:
        generations="outputs/inference/grpo_learned.json",
        manifest="outputs/manifests/generate_grpo_learned.json",
    log:
        "logs/generate_grpo_learned.log",
    benchmark:
        "outputs/benchmarks/generate_grpo_learned.tsv"
    shadow:
        "minimal"
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: 1
    params:
        code=code_hash("generate_grpo_learned"),
        config=stage_config_json(config, "generate_grpo_learned"),
    shell:
        stage_command("generate_grpo_learned")
