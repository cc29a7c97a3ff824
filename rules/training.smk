# The resumable training branches: the SFT actor, the Bradley-Terry reward model, PPO's actor
# and critic (against the frozen reward model and reference), and the two async GRPO runs from
# the SFT actor on the 672 rollout prompts (a: the rubric as an exact verifier on the train
# families, b: the frozen learned reward model; the trainer, a spawned rollout worker and the
# embedded generation server share the rule's one thread). Each runs three times:
# interrupted (after SFT/reward epoch 1, PPO iteration 40, half the GRPO steps), resumed from
# that state in a fresh process, and straight through; `<branch>_resume_check` passes only if
# resume and continuous end in bitwise-equal states. The resume's exports are the policy. With
# resume_triples false (the seeds target's other seeds), the straight run alone runs and exports.


for branch in EXPORTS:
    for mode in modes(config):
        stage = f"{branch}_{mode}"

        rule:
            name:
                stage
            input:
                **training_inputs(branch, mode),
                corpus=rules.prepare.output.manifest,
                model=rules.base_model.output.manifest,
            output:
                **stage_output(stage),
            log:
                **logs(stage),
            benchmark:
                layout.benchmark(stage)
            priority: stage_priority(stage)
            conda:
                "../workflow/envs/reprorl.yaml"
            threads: stage_threads(stage)
            resources:
                **stage_resources(
                    stage, mem_mb=6000 if branch.startswith("grpo_") else 4000
                ),
            params:
                **stage_params(stage),
            shell:
                STAGE_COMMAND

    if not config["resume_triples"]:
        continue
    stage = f"{branch}_resume_check"

    rule:
        name:
            stage
        input:
            continuous=str(layout.state(branch, "continuous")),
            resumed=str(layout.state(branch, "resume")),
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
        params:
            **stage_params(stage),
        shell:
            STAGE_COMMAND


# Rubric success and reward-model score of the responses PPO sampled (first/last 10
# iterations); an evaluation that reads the rollout prompts' situations, never a training input.
rule ppo_report:
    input:
        corpus=rules.prepare.output.manifest,
        rollouts=rules.ppo_continuous.output.rollouts,
    output:
        **stage_output("ppo_report"),
    log:
        layout.log("ppo_report"),
    benchmark:
        layout.benchmark("ppo_report")
    priority: stage_priority("ppo_report")
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: stage_threads("ppo_report")
    params:
        **stage_params("ppo_report"),
    shell:
        STAGE_COMMAND
