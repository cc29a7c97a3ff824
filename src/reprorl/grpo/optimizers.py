"""The optimizer of a run, by `optim` as TRL's Trainer names them, with `optim_args`.

AdamW (`adamw_torch_fused`, `adamw_torch`) reads `adam_beta1`, `adam_beta2`, `adam_epsilon`
and `weight_decay`; `sgd`, `adagrad` and `rmsprop` are torch's, built by transformers'
`Trainer.get_optimizer_cls_and_kwargs` from `optim_args` ("momentum=0.9,nesterov=true"), with
`weight_decay` too. A key of `optim_args` the optimizer does not read is refused, where
transformers would ignore it. Weight decay applies to every trained parameter (TRL's Trainer
exempts biases and norms, which a LoRA adapter does not train).
"""

from __future__ import annotations

import torch

ADAMW = ("adamw_torch_fused", "adamw_torch")
# what transformers reads of optim_args for each (trainer_optimizer.py)
OPTIM_ARGS = {"sgd": ("momentum", "dampening", "weight_decay", "nesterov"),
              "adagrad": ("lr_decay", "weight_decay", "eps"),
              "rmsprop": ("momentum", "alpha", "eps", "weight_decay", "centered")}
NAMES = (*ADAMW, *OPTIM_ARGS)


def parse(optim_args: str | None) -> dict[str, str]:
    """`optim_args` as transformers parses it: "key=value" pairs separated by commas."""
    pairs = (optim_args or "").replace(" ", "")
    return dict(pair.split("=", 1) for pair in pairs.split(",")) if pairs else {}


def problems(args):
    if args.optim not in NAMES:
        yield f"optim must be one of {list(NAMES)}, got {args.optim!r}"
        return
    try:
        given = parse(args.optim_args)
    except ValueError:
        yield f"optim_args must read 'key=value,key=value', got {args.optim_args!r}"
        return
    read = OPTIM_ARGS.get(args.optim, ())
    unread = sorted(set(given) - set(read))
    if unread:
        what = f"reads {', '.join(read)}" if read else "reads none (set adam_* fields instead)"
        yield f"optim_args {unread} are not read by {args.optim}, which {what}"


def build(parameters: list, args) -> torch.optim.Optimizer:
    if args.optim in ADAMW:
        return torch.optim.AdamW(
            parameters, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon, weight_decay=args.weight_decay,
            fused=args.optim == "adamw_torch_fused")
    from transformers import Trainer

    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    return cls(parameters, **{"weight_decay": args.weight_decay, **kwargs})
