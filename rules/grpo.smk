# Async GRPO from the SFT actor on the 672 rollout prompts: the trainer, a spawned rollout
# worker and the embedded generation server run side by side (two threads give them the
# cores). (a) the rubric as an exact verifier on the train families, (b) the frozen learned
# reward model. Both policies then face the same held-out generation as SFT and PPO.

# what each run's reward needs beyond the prompts: the verifier reads the rollout prompts'
# situations (in the corpus), the learned reward the frozen reward model
GRPO_REWARD_INPUTS = {"verifier": {}, "learned": {"reward": final_files("reward")}}

for run in GRPO_RUNS:
    stage = f"grpo_{run}"

    rule:
        name:
            stage
        input:
            **GRPO_REWARD_INPUTS[run],
            corpus=rules.prepare.output.manifest,
            model=rules.base_model.output.manifest,
            sft=final_files("sft"),
        output:
            **stage_output(stage),
        log:
            layout.log(stage),
        benchmark:
            layout.benchmark(stage)
        conda:
            "../workflow/envs/reprorl.yaml"
        threads: stage_threads(stage)
        resources:
            mem_mb=6000,
        params:
            **stage_params(stage),
        shell:
            STAGE_COMMAND
