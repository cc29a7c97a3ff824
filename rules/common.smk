# Shared helpers: config validation and the per-stage params every rule carries.
#
# Snakemake re-runs a job when its params change (rerun trigger "params"). Each rule therefore
# passes `code`, the hash of the reprorl modules it runs, and `config`, the part of the
# configuration it reads: editing src/reprorl/base_model.py or model.* re-runs base_model and
# its dependents only.
from reprorl.codehash import code_hash
from reprorl.config import stage_config_json, validate
from reprorl.report import FIGURES as REPORT_FIGURES

config.update(validate(config))


def base_model_output():
    """The embedded base is built by this rule; a local model is only verified by it."""
    files = {
        "summary": "outputs/base-model.json",
        "manifest": "outputs/manifests/base_model.json",
    }
    if config["model"]["source"] == "embedded":
        files["model"] = directory(config["model"]["path"])
    return files


def warmstart_output(branch, mode):
    """Outputs of an SFT or reward-model branch (mode: interrupt, continuous, resume)."""
    files = {
        "state": f"assets/checkpoints/{branch}-{mode}.pt.gz",
        "report": f"outputs/learning/{branch}/{mode}.json",
        "manifest": f"outputs/manifests/{branch}_{mode}.json",
    }
    if mode == "resume":
        files["final"] = f"assets/checkpoints/{branch}-final.safetensors"
        files["final_manifest"] = f"assets/checkpoints/{branch}-final.json"
        if branch == "sft":
            files["peft"] = directory("assets/checkpoints/sft-peft")
    return files


def stage_command(stage):
    """The shell command of a stage rule (its config subset travels as params.config)."""
    return (
        f"python -m reprorl {stage} --config-json {{params.config:q}}"
        " --threads {threads} > {log} 2>&1"
    )


def ppo_output(mode):
    """Outputs of a PPO branch (mode: interrupt, continuous, resume)."""
    files = {
        "state": f"assets/checkpoints/ppo-{mode}.pt.gz",
        "report": f"outputs/learning/ppo/{mode}.json",
        "rollouts": directory(f"outputs/learning/rollouts/{mode}"),
        "manifest": f"outputs/manifests/ppo_{mode}.json",
    }
    if mode == "resume":
        for name in ("ppo", "critic"):
            files[f"{name}_final"] = f"assets/checkpoints/{name}-final.safetensors"
            files[f"{name}_final_manifest"] = f"assets/checkpoints/{name}-final.json"
        files["peft"] = directory("assets/checkpoints/ppo-peft")
    return files


def final_checkpoint(name):
    """The final export of a role: safetensors and its JSON manifest."""
    return [
        f"assets/checkpoints/{name}-final.safetensors",
        f"assets/checkpoints/{name}-final.json",
    ]


def grpo_output(run):
    """Outputs of an async GRPO run (run: verifier, learned)."""
    return {
        "final": f"assets/checkpoints/grpo_{run}-final.safetensors",
        "final_manifest": f"assets/checkpoints/grpo_{run}-final.json",
        "peft": directory(f"assets/checkpoints/grpo_{run}-peft"),
        "report": f"outputs/learning/grpo/{run}.json",
        "metrics": f"outputs/learning/grpo/{run}-metrics.jsonl",
        "run_dir": directory(f"assets/grpo/{run}"),
        "manifest": f"outputs/manifests/grpo_{run}.json",
    }
