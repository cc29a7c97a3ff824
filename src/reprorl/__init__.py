"""reprorl: a reproducible RLHF pipeline (SFT, Bradley-Terry reward model, PPO, async GRPO).

Five packages, each importing only those below it (tests/test_layers.py holds them to it):

    reprorl.pipeline  the Snakemake stages, one module per rule family, and their reports
    reprorl.grpo      the async GRPO trainer library (trainer, rollout worker, queue, packing)
    reprorl.serve     the generation server: engine, HTTP API, client, weight loading
    reprorl.model     roles, LoRA, encoding and chat templates, the loss formulas
    reprorl.core      stage registry, artifact paths, manifests, config, devices, resume states

`reprorl.cli` (`reprorl <stage>`, `python -m reprorl <stage>`) sits above them all.
"""

__version__ = "0.1.0"
