"""The models' parameter shapes the steps run on: GPT-2 in transformers' GPT2LMHeadModel layout and torchvision's
ResNet-50, without building either (no memory, no time)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def gpt2_shapes(layers: int = 6, d: int = 512, vocab: int = 16384, context: int = 64) -> list[tuple[str, tuple]]:
    """(name, shape) of every parameter of a transformers GPT2LMHeadModel in its order (the head is tied to wte):
    the DDP benchmark's GPT-2 by default (6 x 512, vocabulary 16384, context 64: 76 tensors, 27.3M elements)."""
    shapes = [("transformer.wte.weight", (vocab, d)), ("transformer.wpe.weight", (context, d))]
    for i in range(layers):
        h = f"transformer.h.{i}."
        shapes += [(h + "ln_1.weight", (d,)), (h + "ln_1.bias", (d,)),
                   (h + "attn.c_attn.weight", (d, 3 * d)), (h + "attn.c_attn.bias", (3 * d,)),
                   (h + "attn.c_proj.weight", (d, d)), (h + "attn.c_proj.bias", (d,)),
                   (h + "ln_2.weight", (d,)), (h + "ln_2.bias", (d,)),
                   (h + "mlp.c_fc.weight", (d, 4 * d)), (h + "mlp.c_fc.bias", (4 * d,)),
                   (h + "mlp.c_proj.weight", (4 * d, d)), (h + "mlp.c_proj.bias", (d,))]
    return shapes + [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]


def resnet50_shapes() -> list[tuple[str, tuple]]:
    """(name, shape) of torchvision's ResNet-50 parameters (operations/models.ResNet50, built on the meta device:
    no memory, no time)."""
    from ..models import ResNet50
    with torch.device("meta"):
        model = ResNet50()
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


@dataclass(frozen=True)
class GPT2Size:
    layers: int
    d: int
    heads: int
    vocab: int
    context: int

    def shapes(self):
        return gpt2_shapes(self.layers, self.d, self.vocab, self.context)


GPT2_124M = GPT2Size(12, 768, 12, 50257, 1024)
GPT2_DRY_RUN = GPT2Size(12, 128, 4, 256, 64)        # 148 tensors, 2.5M elements: the CPU dry run's stand-in


def scaled_resnet50(scale: int):
    """ResNet-50's tensors, each at 1/``scale`` of its elements (flattened) where ``scale`` > 1."""
    return [(n, s if scale == 1 else (max(1, math.prod(s) // scale),)) for n, s in resnet50_shapes()]
