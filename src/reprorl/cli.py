"""Command line: `reprorl <stage> --config configs/default.yaml` (or `--config-json` from rules).

Each stage runs inside a `StageRun`, which writes the stage's manifest after its outputs. A
`ReproError` (bad input, preserved artifact, failed check) prints one line and exits with 2; a
training stage stopped by SIGTERM or SIGUSR1 exits with 128 + the signal (`core/preempt.py`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from reprorl.core import config as configuration
from reprorl.core import layout, numerics, stages
from reprorl.core.codehash import code_hash
from reprorl.core.errors import Preempted, ReproError
from reprorl.core.manifest import StageRun, audit_manifests
from reprorl.core.stages import STAGES


def _log(message: str) -> None:
    print(message, flush=True)


def run_stage(name: str, config: dict, threads: int, checkpoint_every: str | None = None) -> dict:
    numerics.pin(config["numerics"])  # before torch: every process the stage starts inherits it
    import torch

    from reprorl.core import devices

    numerics.check()
    # under torchrun (a GRPO run's ranks) the job's threads are shared by its processes
    torch.set_num_threads(max(1, threads // int(os.environ.get("WORLD_SIZE", "1"))))
    torch.use_deterministic_algorithms(True)
    if "model" in STAGES[name].config_keys:
        # `auto` is recorded as what it meant here, so a resume elsewhere is compared with it
        setting = config["model"]["device"]
        device = devices.prepare(setting)
        if setting == "auto":
            config = {**config, "model": {**config["model"], "device": device.type}}
    subset = configuration.stage_config(config, name)
    module = importlib.import_module(f"reprorl.{STAGES[name].module}")
    # the rules pass it in the environment (a config subset has no checkpoint_every)
    every = (checkpoint_every or os.environ.get(configuration.CHECKPOINT_EVERY_ENV)
             or config.get("checkpoint_every"))
    with StageRun(name, config=subset, code_hash=code_hash(name), checkpoint_every=every) as run:
        return module.stage(name, config, run, log=_log)


def declarations(config: dict) -> dict:
    """The registry as a rule reads it, for `reprorl stages`."""
    def paths(files: dict) -> dict:
        return {name: [str(p) for p in path] if isinstance(path, list) else str(path)
                for name, path in files.items()}

    return {name: {"module": f"reprorl.{stage.module}", "config_keys": list(stage.config_keys),
                   "threads": stages.threads(name, config), "priority": stage.priority,
                   "outputs": paths(stages.outputs(name, config))}
            for name, stage in STAGES.items() if name != "audit"}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="reprorl", description=__doc__.splitlines()[0])
    commands = top.add_subparsers(dest="command", required=True)
    for name in (n for n in STAGES if n != "audit"):
        sub = commands.add_parser(name, help=f"run stage {name}")
        source = sub.add_mutually_exclusive_group(required=True)
        source.add_argument("--config", help="YAML profile, e.g. configs/default.yaml")
        source.add_argument("--config-json", help="validated config as JSON (used by rules)")
        sub.add_argument("--threads", type=int, default=None,
                         help="torch threads (default: what the stage's rule declares)")
        sub.add_argument("--checkpoint-every", default=None,
                         help="a training stage's in-rule checkpoints: steps, or seconds as "
                              "'60s' (default: $REPRORL_CHECKPOINT_EVERY, which the rules set, "
                              "or the config's checkpoint_every)")
    commands.add_parser("serve", add_help=False,
                        help="vLLM-compatible generation server (reprorl serve --help)")
    listing = commands.add_parser(
        "stages", help="every stage's declaration: module, config keys, threads, priority and "
                       "the files it writes (what each Snakemake rule declares)")
    listing.add_argument("--config", default="configs/default.yaml",
                         help="YAML profile the paths and threads follow")
    audit = commands.add_parser("audit", help="re-hash every file named by every manifest")
    audit.add_argument("--manifests", default=str(layout.MANIFESTS))
    costs = commands.add_parser(
        "costs", help="every stage's wall and CPU seconds and peak memory, from the manifests")
    costs.add_argument("--manifests", default=str(layout.MANIFESTS))
    seed = commands.add_parser(
        "seed-run", help="the main results under another learning seed, in outputs/seeds/SEED "
                         "(a nested Snakemake; the seeds target's step)")
    seed.add_argument("seed", type=int)
    seed.add_argument("--config-json", required=True, help="validated config as JSON")
    seed.add_argument("--cores", type=int, default=1)
    seed.add_argument("--dry-run", action="store_true", help="list the jobs it would run")
    digests = commands.add_parser(
        "digests", help="write this folder's run as digests (every tensor, the results rows, "
                        "each stage), to compare on another machine with `reprorl bitcheck`")
    digests.add_argument("--write", required=True, help="the digest file to write")
    bitcheck = commands.add_parser(
        "bitcheck", help="compare this folder's run with recorded digests: same bits, or the "
                         "first stage that differs and whether the kernel settings explain it")
    bitcheck.add_argument("against", nargs="*",
                          help="digest files or run folders (default: the digests the README's "
                               "results block was made from)")
    table = commands.add_parser(
        "readme-results", help="rewrite the README's results block from a run's outputs")
    table.add_argument("--results", default=str(layout.RESULTS))
    table.add_argument("--manifests", default=str(layout.MANIFESTS),
                       help="the same run's stage manifests (its dates, duration and CPU)")
    table.add_argument("--readme", default="README.md")
    table.add_argument("--commit", help="the commit the run ran (default: HEAD of the "
                                        "checkout holding --results)")
    table.add_argument("--seeds", default=str(layout.SEEDS_SUMMARY),
                       help="the seeds target's summary (every policy over the seeds)")
    table.add_argument("--digests", default=str(layout.README_DIGESTS),
                       help="where the run's digests go, for `reprorl bitcheck` ('' : none)")
    return top


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # its own flags (vLLM's names), parsed by the server
        early = argparse.ArgumentParser(add_help=False)
        early.add_argument("--numerics", choices=numerics.MODES, default=numerics.mode())
        try:  # pinned before the server imports torch
            numerics.pin(early.parse_known_args(argv[1:])[0].numerics)
        except ReproError as error:
            print(f"reprorl serve: error: {error}", file=sys.stderr, flush=True)
            return 2
        from reprorl.serve.server import main as serve

        return serve(argv[1:])
    args = parser().parse_args(argv)
    try:
        if args.command == "audit":
            result = audit_manifests(args.manifests)
        elif args.command == "stages":
            result = declarations(configuration.load(args.config))
        elif args.command == "costs":
            from reprorl.pipeline.evaluate import costs

            result = costs(args.manifests)
        elif args.command == "seed-run":
            from reprorl.pipeline import seeds

            config = configuration.load_json(args.config_json)
            numerics.pin(config["numerics"])  # the nested Snakemake's jobs inherit it
            return seeds.run(args.seed, config, args.cores, args.dry_run)
        elif args.command == "digests":
            from reprorl.pipeline import bitcheck

            result = bitcheck.write(Path(args.write))
        elif args.command == "bitcheck":
            from reprorl.pipeline import bitcheck

            reports, same = bitcheck.check([Path(p) for p in args.against])
            _log(json.dumps(reports, sort_keys=True))
            return 0 if same else 1
        elif args.command == "readme-results":
            from reprorl.pipeline import readme

            result = readme.main(args.results, args.readme, args.manifests, args.commit,
                                 args.seeds, args.digests)
        else:
            if args.config:
                config = configuration.load(args.config)
            else:
                config = configuration.load_json(args.config_json)
            threads = numerics.threads(stages.threads(args.command, config), args.threads,
                                       config["numerics"])
            result = run_stage(args.command, config, threads, args.checkpoint_every)
    except Preempted as stop:  # a failure to Snakemake, which reruns the job
        print(f"reprorl {args.command}: {stop}", file=sys.stderr, flush=True)
        return stop.status
    except ReproError as error:
        print(f"reprorl {args.command}: error: {error}", file=sys.stderr, flush=True)
        return 2
    _log(json.dumps(result, indent=1, sort_keys=True))
    return 0
