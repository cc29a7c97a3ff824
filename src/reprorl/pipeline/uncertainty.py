"""95 % bootstrap intervals over prompts for the rates and means the results report.

Rows that share a prompt form one cluster (the 80 probe rows are 20 contexts, the 260 rows 200):
a resample draws clusters with replacement, so repeated rows never count as independent
evidence. Every statistic is a ratio of two sums over the drawn rows (a rate: successes over
rows; a rate among recognized answers: e.g. relevant over recognized; a mean: total over rows),
so all resamples are one matrix product of the draw counts and the per-cluster sums.
A policy's difference to SFT is paired: the same clusters are drawn for both, since both
answered the same prompts. Intervals are percentile intervals (2.5 %, 97.5 %) of `RESAMPLES`
resamples from a generator seeded with `SEED`, so they replay bit for bit; a resample whose
denominator is 0 (no recognized answer drawn) is left out of that statistic.
"""

from __future__ import annotations

import numpy as np

SEED, RESAMPLES = 2022, 2000
# statistic -> (numerator, denominator), each a per-row value of `row_values`
STATISTICS = {
    "rubric_success_rate": ("rubric_success", "row"),
    "recognized_rate": ("recognized", "row"),
    "relevant_rate_among_recognized": ("relevant_recognized", "recognized"),
    "unsupported_certainty_rate_among_recognized": ("unsupported_recognized", "recognized"),
    "mean_learned_score": ("learned_score", "row"),
    "mean_logratio_per_token": ("logratio_per_token", "row"),
}
VALUES = ("row", "rubric_success", "recognized", "relevant_recognized",
          "unsupported_recognized", "learned_score", "logratio_per_token")


def row_values(row: dict) -> list[float]:
    """A judged row (`evaluate.judge` plus its prompt) as the numbers the statistics sum."""
    recognized = bool(row["recognized"])
    return [1.0, float(row["rubric_success"]), float(recognized),
            float(recognized and bool(row["relevant"])),
            float(recognized and row["unsupported_certainty"] is True),
            float(row["learned_score"]), float(row["logratio_per_token"])]


def cluster_sums(rows: list[dict]) -> tuple[list[str], np.ndarray]:
    """The prompts in first-seen order and, per prompt, the sums of its rows' values."""
    order: dict[str, int] = {}
    for row in rows:
        order.setdefault(row["prompt"], len(order))
    sums = np.zeros((len(order), len(VALUES)))
    for row in rows:
        sums[order[row["prompt"]]] += row_values(row)
    return list(order), sums


def draws(clusters: int) -> np.ndarray:
    """(RESAMPLES, clusters) counts: how often each cluster is drawn in each resample."""
    rng = np.random.Generator(np.random.PCG64(SEED))
    return rng.multinomial(clusters, np.full(clusters, 1.0 / clusters), size=RESAMPLES)


def _ratios(totals: np.ndarray) -> dict[str, np.ndarray]:
    """Each statistic from (..., len(VALUES)) totals; NaN where its denominator is 0."""
    out = {}
    with np.errstate(invalid="ignore", divide="ignore"):
        for name, (numerator, denominator) in STATISTICS.items():
            den = totals[..., VALUES.index(denominator)]
            out[name] = np.where(den > 0, totals[..., VALUES.index(numerator)] / den, np.nan)
    return out


def _interval(values: np.ndarray) -> list[float] | None:
    kept = values[~np.isnan(values)]
    if not len(kept):
        return None
    low, high = np.percentile(kept, [2.5, 97.5])
    return [float(low), float(high)]


def intervals(rows: list[dict]) -> dict[str, list[float] | None]:
    """Each statistic's 95 % interval over the rows' prompts."""
    _, sums = cluster_sums(rows)
    return {name: _interval(values)
            for name, values in _ratios(draws(len(sums)) @ sums).items()}


def paired_difference(rows: list[dict], baseline: list[dict]) -> dict[str, dict]:
    """Each statistic of `rows` minus that of `baseline` (the same prompts): the difference,
    its paired 95 % interval, and whether 0 lies inside it (within noise)."""
    prompts, sums = cluster_sums(rows)
    base_prompts, base_sums = cluster_sums(baseline)
    if sorted(prompts) != sorted(base_prompts):
        raise ValueError("a paired difference needs the same prompts on both sides")
    base_sums = base_sums[[base_prompts.index(p) for p in prompts]]
    counts = draws(len(prompts))
    point = {name: a - b for (name, a), b in zip(_ratios(sums.sum(0)).items(),
                                                  _ratios(base_sums.sum(0)).values())}
    drawn, drawn_base = _ratios(counts @ sums), _ratios(counts @ base_sums)
    out = {}
    for name in STATISTICS:
        interval = _interval(drawn[name] - drawn_base[name])
        difference = None if np.isnan(point[name]) else float(point[name])
        out[name] = {"difference": difference, "interval_95": interval,
                     "within_noise": None if interval is None or difference is None
                     else bool(interval[0] <= 0 <= interval[1])}
    return out


def over_seeds(per_seed: list[list[dict]], baseline: list[list[dict]] | None = None
               ) -> dict[str, dict]:
    """Each statistic's mean over learning seeds (one list of rows per seed) and its 95 %
    interval over seeds and prompts: a resample draws the seeds with replacement, then in each
    drawn seed its prompts with replacement, and averages the drawn seeds' statistics. So the
    interval covers what another training draw changes as well as what other prompts change.
    With `baseline` (the same seeds' SFT rows), the paired difference instead: each seed's
    statistic minus its SFT's on the same drawn prompts."""
    rng = np.random.Generator(np.random.PCG64(SEED))
    seeds = len(per_seed)
    picked = rng.multinomial(seeds, np.full(seeds, 1.0 / seeds), size=RESAMPLES)
    points, drawn = [], []
    for index, rows in enumerate(per_seed):
        prompts, sums = cluster_sums(rows)
        counts = rng.multinomial(len(prompts), np.full(len(prompts), 1.0 / len(prompts)),
                                 size=RESAMPLES)
        point, resampled = _ratios(sums.sum(0)), _ratios(counts @ sums)
        if baseline is not None:
            base_prompts, base_sums = cluster_sums(baseline[index])
            base_sums = base_sums[[base_prompts.index(p) for p in prompts]]
            point = {k: v - b for (k, v), b in zip(point.items(),
                                                   _ratios(base_sums.sum(0)).values())}
            resampled = {k: v - b for (k, v), b in zip(resampled.items(),
                                                       _ratios(counts @ base_sums).values())}
        points.append(point)
        drawn.append(resampled)
    out = {}
    for name in STATISTICS:
        values = np.array([float(p[name]) for p in points])
        matrix = np.stack([d[name] for d in drawn], axis=1)  # (RESAMPLES, seeds)
        weights = np.where(np.isnan(matrix), 0, picked)
        with np.errstate(invalid="ignore", divide="ignore"):
            means = np.nansum(np.where(weights > 0, matrix, 0) * weights, 1) / weights.sum(1)
        kept = values[~np.isnan(values)]
        out[name] = {"mean": float(kept.mean()) if len(kept) else None,
                     "per_seed": [None if np.isnan(v) else float(v) for v in values],
                     "interval_95": _interval(means)}
    return out
