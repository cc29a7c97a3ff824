"""reprorl: a reproducible RLHF pipeline (SFT, Bradley-Terry reward model, PPO, async GRPO).

Each pipeline stage is a module with a `stage(config, run)` entry that the command line
(`reprorl <stage>`, `python -m reprorl <stage>`) calls and that one Snakemake rule wraps.
"""

__version__ = "0.1.0"
