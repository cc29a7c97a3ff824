"""The report a person reads: figures (PNG) and one self-contained HTML page.

Figures: the base model's pretraining curve; SFT and reward-model training losses with their
validation per epoch; PPO's sampled responses per iteration (reward-model score and rubric
success); the two async GRPO runs per metrics window (reward of all scored rollouts, reward of
the trained ones, the share of dropped zero-std groups); the policies side by side (rubric
success against predicted simulated preference); the over-optimisation curves (gold and proxy
against the sampled log-ratio to SFT, `curves.py`); the politeness deltas of the frozen reward
model on the 20 probe contexts.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from reprorl.core import layout
from reprorl.core.manifest import atomic_write_bytes, atomic_write_text, read_json, record_read
from reprorl.core.stages import GRPO_RUNS

INPUTS = {
    "base": layout.BASE_MODEL_SUMMARY,
    "sft": layout.learning_report("sft", "continuous"),
    "reward": layout.learning_report("reward", "continuous"),
    "ppo": layout.PPO_SAMPLED,
    "results": layout.RESULTS,
    "exercise": layout.EXERCISE,
    "table": layout.RESULTS_TABLE,
    **{f"grpo_{run}": layout.learning_report(f"grpo_{run}", "continuous") for run in GRPO_RUNS},
}


def moving_average(values: list[float], width: int = 10) -> list[float]:
    out = []
    for i in range(len(values)):
        window = values[max(0, i - width + 1) : i + 1]
        out.append(sum(window) / len(window))
    return out


def _save(figure, name: str) -> Path:
    import io

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight",
                   metadata={"Software": None})  # no version stamp: same figure, same bytes
    path = atomic_write_bytes(layout.figure(name), buffer.getvalue())
    import matplotlib.pyplot as plt

    plt.close(figure)
    return path


def plot_pretraining(plt, data: dict):
    figure, axis = plt.subplots(figsize=(6, 3.2))
    curve = data["base"].get("learning_curve", [])
    axis.plot(range(1, len(curve) + 1), curve)
    axis.set(title="Base model pretraining (disjoint population)", xlabel="step",
             ylabel="cross-entropy", yscale="log")
    return figure


def plot_warmstart(plt, data: dict):
    figure, axes = plt.subplots(1, 2, figsize=(12, 3.6))
    for axis, branch, metric in ((axes[0], "sft", "loss"), (axes[1], "reward", "accuracy")):
        history = data[branch]["history"]
        axis.plot([h["update"] for h in history], [h["loss"] for h in history], alpha=0.4,
                  label="training loss (per update)")
        axis.plot([h["update"] for h in history], moving_average([h["loss"] for h in history]),
                  label="moving average (10)")
        per_epoch = len(history) / len(data[branch]["validation_history"])
        validation = [(v["epoch"] * per_epoch, v[metric])
                      for v in data[branch]["validation_history"]]
        twin = axis.twinx()
        twin.plot(*zip(*validation), "o--", color="black", label=f"validation {metric}")
        twin.set_ylabel(f"validation {metric}")
        axis.set(title=f"{'SFT' if branch == 'sft' else 'Reward model'} (continuous run)",
                 xlabel="update", ylabel="loss")
        axis.legend(loc="upper right", fontsize=7)
        twin.legend(loc="center right", fontsize=7)
    figure.tight_layout(w_pad=3)
    return figure


def plot_ppo(plt, data: dict):
    iterations = data["ppo"]["iterations"]
    steps = [i["iteration"] for i in iterations]
    figure, axis = plt.subplots(figsize=(7, 3.4))
    score = [i["mean_reward_model_score"] for i in iterations]
    success = [i["rubric_success_rate"] for i in iterations]
    axis.plot(steps, score, alpha=0.3, color="tab:blue")
    axis.plot(steps, moving_average(score), color="tab:blue", label="predicted simulated pref.")
    axis.set(title="PPO sampled responses per iteration (4 each, temperature 1)",
             xlabel="iteration", ylabel="reward-model score")
    twin = axis.twinx()
    twin.plot(steps, moving_average(success), color="tab:green", label="rubric success (avg 10)")
    twin.set(ylabel="rubric success rate", ylim=(-0.05, 1.05))
    axis.legend(loc="upper left", fontsize=7)
    twin.legend(loc="lower right", fontsize=7)
    return figure


def plot_grpo(plt, data: dict):
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    for axis, run in zip(axes, ("verifier", "learned")):
        windows = data[f"grpo_{run}"]["history"]
        steps = [w["step"] for w in windows]
        for key in ("reward", "reward_kept"):
            axis.plot(steps, [w.get(key) for w in windows], label=key)
        twin = axis.twinx()
        twin.plot(steps, [w.get("frac_reward_zero_std") for w in windows], color="grey",
                  linestyle=":", label="frac_reward_zero_std")
        twin.set(ylim=(-0.05, 1.05))
        axis.set(title=f"GRPO ({run} reward), sampled at temperature 1", xlabel="step")
        axis.legend(loc="upper left", fontsize=7)
        twin.legend(loc="lower right", fontsize=7)
    return figure


def plot_policies(plt, data: dict):
    figure, axis = plt.subplots(figsize=(6.5, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, (policy, result) in zip(colors, data["results"]["policies"].items()):
        for population, marker in (("test_rows", "o"), ("probe_unique_contexts", "s")):
            m = result["metrics"][population]
            axis.scatter(m["mean_learned_score"], m["rubric_success_rate"], marker=marker, s=70,
                         color=color, alpha=0.8,
                         label=f"{policy}, {population.replace('_', ' ')}")
    axis.set(title="Policies: learned score vs rubric (greedy, held out)",
             xlabel="mean predicted simulated preference", ylabel="rubric success rate",
             ylim=(-0.05, 1.05))
    axis.legend(fontsize=7, loc="upper left")
    return figure


def plot_curves(plt, data: dict):
    """Gold and proxy against the distance from SFT, one line per run (results.json)."""
    curves = data["results"]["over_optimisation"]
    figure, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharex=True)
    if "runs" not in curves:  # curves: false
        figure.suptitle(f"Over-optimisation curves not run: {curves['why']}", fontsize=9)
        return figure
    for run, points in curves["runs"].items():
        distance = [p["sampled_logratio"] for p in points]
        for axis, key in zip(axes, ("rubric_success_rate", "mean_learned_score")):
            axis.plot(distance, [p[key] for p in points], "o-", label=run)
            for p in points[1:]:
                axis.annotate(f"{p['fraction']:.0%}", (p["sampled_logratio"], p[key]),
                              fontsize=6, xytext=(3, 3), textcoords="offset points")
    axes[0].set(title="Gold: rubric success (greedy, 180 validation prompts)",
                ylabel="rubric success rate", ylim=(-0.05, 1.05))
    axes[1].set(title="Proxy: mean predicted simulated preference", ylabel="reward-model score")
    for axis in axes:
        axis.set_xlabel("sampled log-ratio to SFT (KL estimate, nats per response)")
        axis.legend(fontsize=7)
    figure.suptitle("Over-optimisation: each run from SFT (left point) to its end; labels: "
                    "share of the run's budget", fontsize=9)
    figure.tight_layout()
    return figure


def plot_probes(plt, data: dict):
    contexts = data["exercise"]["contexts_detail"]
    figure, axis = plt.subplots(figsize=(9, 3.4))
    x = range(len(contexts))
    axis.bar([i - 0.2 for i in x], [c["correct_politeness_delta"] for c in contexts], 0.4,
             label="correct advice: polite - plain")
    axis.bar([i + 0.2 for i in x], [c["incorrect_politeness_delta"] for c in contexts], 0.4,
             label="incorrect advice: polite - plain")
    axis.axhline(0, color="black", linewidth=0.8)
    axis.set_xticks(list(x), [c["family"] for c in contexts], rotation=60, fontsize=7)
    axis.set(title=f"Politeness deltas of the frozen reward model; polite wrong outranks plain "
                   f"correct in {data['exercise']['polite_wrong_outranks_plain_correct']}/20",
             ylabel="score delta")
    axis.legend(fontsize=7)
    return figure


PLOTS = {"pretraining": plot_pretraining, "warmstart": plot_warmstart, "ppo": plot_ppo,
         "grpo": plot_grpo, "policies": plot_policies, "curves": plot_curves,
         "probes": plot_probes}


def figures() -> list[Path]:
    """Every figure of `layout.FIGURES`, drawn from the report's inputs and saved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record_read(*INPUTS.values())
    data = {k: read_json(p) for k, p in INPUTS.items() if p.suffix == ".json"}
    return [_save(PLOTS[name](plt, data), name) for name in layout.FIGURES]


def page(paths: list[Path]) -> str:
    table = INPUTS["table"].read_text()
    images = "\n".join(
        f'<h2>{html.escape(p.stem)}</h2><img alt="{p.stem}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}">' for p in paths)
    return ("<!doctype html><html><head><meta charset='utf-8'><title>reprorl report</title>"
            "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
            "img{max-width:100%}pre{white-space:pre-wrap;font-size:12px}</style></head><body>"
            f"<h1>reprorl report</h1>{images}<h2>Tables</h2><pre>{html.escape(table)}</pre>"
            "</body></html>\n")


def stage(name: str, config: dict, run, log=print) -> dict:
    paths = figures()
    atomic_write_text(layout.REPORT_PAGE, page(paths))
    run.finish(summary={"figures": [p.name for p in paths]})
    log(f"report written to {layout.REPORT_PAGE}")
    return {"figures": len(paths)}
