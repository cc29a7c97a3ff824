# The seeds target (reprorl.pipeline.seeds), not part of the default one:
#   snakemake --cores all outputs/seeds/summary.json      (--config seeds=[49,50,51] for others)
# The main seed's results are the main run's; each other seed's come from a nested Snakemake
# run of this workflow in outputs/seeds/<seed>/ (the corpus and base model copied from this run,
# every learning stage's seeds moved, no resume triples); the summary gives each policy's mean
# over the seeds, each seed's figure and an interval over seeds and prompts.
from reprorl.pipeline.seeds import results_path


wildcard_constraints:
    seed=r"\d+",


rule seed_run:
    input:
        corpus=rules.prepare.output.manifest,
        model=rules.base_model.output.manifest,
    output:
        results=str(layout.seed_dir("{seed}") / layout.RESULTS),
    log:
        layout.log("seed_run-{seed}"),
    benchmark:
        layout.benchmark("seed_run-{seed}")
    conda:
        "../workflow/envs/reprorl.yaml"
    # one core here, yet the nested run may use every core (nested_cores): the seed runs and
    # the main run's jobs then fill each other's gaps, two at a time on two cores, where a seed
    # holding all cores alone left one idle along its longest path (the SLURM profile sets
    # seed_run's threads itself)
    threads: 1
    params:
        config=json.dumps(
            {k: v for k, v in config.items() if k != "seeds"}, sort_keys=True
        ),
        cores=nested_cores,
    shell:
        "python -m reprorl seed-run {wildcards.seed} --config-json {params.config:q}"
        " --cores {params.cores} > {log} 2>&1"


rule seeds:
    input:
        # the main seed's are the main run's (with its resume triples)
        results=[str(results_path(seed, config)) for seed in config["seeds"]],
    output:
        **stage_output("seeds"),
    log:
        layout.log("seeds"),
    benchmark:
        layout.benchmark("seeds")
    conda:
        "../workflow/envs/reprorl.yaml"
    threads: stage_threads("seeds")
    params:
        **stage_params("seeds"),
    shell:
        STAGE_COMMAND
