"""The learning-rate schedule every optimiser here uses (seed: warm-up 10 %, decay to 10 %)."""


def linear_warmup_decay(step: int, total: int, peak: float, warmup_ratio: float,
                        final_ratio: float = 0.1) -> float:
    """Learning rate of update `step` (0-based) out of `total`.

    Linear warm-up over the first `max(1, int(total * warmup_ratio))` updates, reaching `peak`
    at the last warm-up update, then linear decay to `final_ratio * peak` at the last update.
    """
    warmup = max(1, int(total * warmup_ratio))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup - 1))
    return peak * (1.0 - (1.0 - final_ratio) * progress)
