"""The examples' ``--optim`` choice: SGD with momentum (the paper's), torch's AdamW, or TernGrad's AdamW
(horovod_terngrad.optim: the ternary noise kept out of Adam's second moment; torch's AdamW, bit for bit,
without TernGrad)."""
from __future__ import annotations

import torch

CHOICES = ("sgd", "adamw", "tg-adamw")


def add_arguments(p, default: str = "sgd") -> None:
    p.add_argument("--optim", choices=CHOICES, default=default,
                   help="sgd (momentum, weight decay), adamw (torch.optim.AdamW) or tg-adamw "
                        "(horovod_terngrad.optim.AdamW, the optimizer to use with TernGrad and Adam)")


def make(args, params, adam_lr: float = 1e-3):
    """The optimizer of ``args.optim``; ``args.lr`` None picks 0.01 for SGD, ``adam_lr`` for the Adams."""
    lr = args.lr if args.lr is not None else (0.01 if args.optim == "sgd" else adam_lr)
    if args.optim == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)
    if args.optim == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=args.weight_decay)
    from horovod_terngrad.optim import AdamW
    return AdamW(params, lr=lr, weight_decay=args.weight_decay)
