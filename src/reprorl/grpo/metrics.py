"""Metric windows with the seed's reduction rules, and their JSONL / console output.

A window is everything recorded since the previous log (the last `logging_steps` optimizer
steps). Per name, decided from its last path part:
- a rate (`..._tokens_per_s`) is recorded as (amount, seconds) pairs: total / total;
- a name with the word `count` is summed;
- a name with the word `max` / `min` keeps the largest / smallest value;
(words are split on `_`, so `mean_terminated_length` is a mean, not a min).
- anything else is the mean of the recorded values.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path


def rule(name: str) -> str:
    last = name.rsplit("/", 1)[-1]
    words = set(last.split("_"))
    if last.endswith("tokens_per_s"):
        return "rate"
    for word, how in (("count", "sum"), ("max", "max"), ("min", "min")):
        if word in words:
            return how
    return "mean"


def reproducible(name: str) -> bool:
    """A metric that is a function of the trained samples alone, so a fixed schedule gives it
    the same value in every run: not a time, a rate, nor the worker's or server's own records
    (`rollout/...`), which depend on what ran when."""
    return not (name.startswith(("perf/", "rollout/")) or name.endswith("_s"))


class MetricsWindow:
    def __init__(self):
        self.values: dict[str, list[float]] = defaultdict(list)
        self.rates: dict[str, list[tuple[float, float]]] = defaultdict(list)

    def clear(self) -> None:
        """Start the next window (the object stays: others hold it to record into)."""
        self.values.clear()
        self.rates.clear()

    def add(self, name: str, value: float) -> None:
        if rule(name) == "rate":
            raise ValueError(f"{name} is a rate: record it with add_rate(amount, seconds)")
        self.values[name].append(float(value))

    def extend(self, name: str, values) -> None:
        for value in values:
            self.add(name, value)

    def add_rate(self, name: str, amount: float, seconds: float) -> None:
        self.rates[name].append((float(amount), float(seconds)))

    def records(self) -> list[tuple]:
        """What this window holds, as `merge` takes it (another rank's part of a step)."""
        return [*(("value", name, v) for name, values in self.values.items() for v in values),
                *(("rate", name, pair) for name, pairs in self.rates.items() for pair in pairs)]

    def merge(self, items) -> None:
        """Records shipped from the rollout worker or another rank: ("value"|"rate", name,
        payload)."""
        for kind, name, payload in items:
            if kind == "rate":
                self.add_rate(name, *payload)
            else:
                self.add(name, payload)

    def reduce(self) -> dict[str, float]:
        out = {}
        for name, values in self.values.items():
            how = rule(name)
            finite = [v for v in values if not math.isnan(v)]
            if how == "sum":
                out[name] = sum(finite)
            elif not finite:
                out[name] = float("nan")
            elif how == "max":
                out[name] = max(finite)
            elif how == "min":
                out[name] = min(finite)
            else:
                out[name] = sum(finite) / len(finite)
        for name, pairs in self.rates.items():
            seconds = sum(s for _, s in pairs)
            out[name] = sum(a for a, _ in pairs) / seconds if seconds > 0 else float("nan")
        return dict(sorted(out.items()))


class MetricsLog:
    """Appends one JSON line per logging window (flushed and fsynced: it survives a kill)."""

    def __init__(self, path: str | Path, resume: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not resume and self.path.exists():
            self.path.unlink()

    def write(self, step: int, metrics: dict[str, float]) -> dict:
        """Append the window; returns its record (NaN written as null)."""
        record = {"step": step, **{k: (None if isinstance(v, float) and math.isnan(v) else v)
                                   for k, v in metrics.items()}}
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        return record

    def records(self) -> list[dict]:
        """The windows written so far (a resume's, from before it, included)."""
        return read_windows(self.path)


def metrics_file(output_dir: str | Path) -> Path:
    """Where the trainer's `MetricsLog` writes: `<output_dir>/metrics.jsonl`, as TRL's
    trainer keeps its log history under its output_dir."""
    return Path(output_dir) / "metrics.jsonl"


def read_windows(path: str | Path) -> list[dict]:
    """The windows a `MetricsLog` wrote, oldest first; none when the file is absent."""
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def console_line(step: int, metrics: dict[str, float]) -> str:
    keys = ("reward", "reward_kept", "frac_reward_zero_std", "entropy",
            "sampling/importance_sampling_ratio/mean", "sample/staleness_mean",
            "rollout/queue_size", "perf/step_s")
    shown = [f"{k.rsplit('/', 1)[-1]}={metrics[k]:.4g}" for k in keys if k in metrics]
    return f"step {step}: " + " ".join(shown)
