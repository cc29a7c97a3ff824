# Shared helpers: config validation and the per-stage params every rule carries.
#
# Snakemake re-runs a job when its params change (rerun trigger "params"). Each rule therefore
# passes `code`, the hash of the reprorl modules it runs, and `config`, the part of the
# configuration it reads: editing src/reprorl/base_model.py or model.* re-runs base_model and
# its dependents only.
from reprorl.codehash import code_hash
from reprorl.config import stage_config_json, validate

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
