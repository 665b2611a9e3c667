"""Models with the parameter shapes of real networks, for the benchmarks (no torchvision CPU build exists
here, so the architectures are written out).  What matters for an exchange is the list of parameter
tensors, in registration order: a ResNet-50 has 161 of them (53 convolutions, 53 BatchNorm weight/bias
pairs, the classifier), most of them tiny; a transformer has embeddings, many LayerNorm and bias vectors
and a few large matrices per block.

    resnet50()          25,557,032 parameters in 161 tensors (torchvision's ResNet-50 exactly)
    transformer()       a GPT-2-style decoder: 12 blocks of width 384, 16k vocabulary (tied head), 148 tensors
    GPT2()              GPT-2 124M in plain torch, transformers' GPT2LMHeadModel's parameter names and shapes
    tiny_tensors(300)   300 small tensors (the per-tensor overhead benchmark)
    mlp(layers, width)  the communication-heavy MLP of the earlier benchmarks

Each ``make(name, **kw)`` returns ``(model, example_input)``; a step is ``model(x).square().mean().backward()``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    """torchvision's resnet50 layout: the same 161 parameter tensors, in the same order."""

    def __init__(self, classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, cin = [], 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            stage = []
            for b in range(blocks):
                stage.append(Bottleneck(cin, width, stride if b == 0 else 1))
                cin = 4 * width
            layers.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(2048, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Transformer(nn.Module):
    """A GPT-2-style decoder (token and position embeddings, pre-LayerNorm blocks, tied output head)."""

    def __init__(self, vocab: int = 16384, d: int = 384, layers: int = 12, heads: int = 6, context: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.ln(self.blocks(x)) @ self.tok.weight.t()


class TinyTensors(nn.Module):
    """``count`` parameter tensors of ``numel`` elements each, all used by every step (a stand-in for the
    per-tensor costs of a network made of many small layers)."""

    def __init__(self, count: int = 300, numel: int = 64):
        super().__init__()
        self.params = nn.ParameterList([nn.Parameter(torch.randn(numel) * 0.1) for _ in range(count)])

    def forward(self, x):
        return sum((x * p).sum(-1, keepdim=True) for p in self.params)


def mlp(layers: int = 4, width: int = 2500) -> nn.Module:
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


class GPT2Logits(nn.Module):
    """A ``transformers`` GPT2LMHeadModel (tied embeddings and head, dropout off) returning its logits, so a
    benchmark step is ``model(x).square().mean().backward()`` as for the other models.  The DDP
    benchmark's GPT-2: 6 layers x 512, vocabulary 16384, context 64 (27.3M parameters in 76 tensors)."""

    def __init__(self, layers: int = 6, d: int = 512, heads: int = 8, vocab: int = 16384, context: int = 64):
        super().__init__()
        try:
            from transformers import GPT2Config, GPT2LMHeadModel
        except ImportError as e:
            raise ImportError("model 'gpt2' needs the transformers package (pip install transformers)") from e
        cfg = GPT2Config(n_layer=layers, n_embd=d, n_head=heads, vocab_size=vocab, n_positions=context,
                         bos_token_id=0, eos_token_id=0,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.lm = GPT2LMHeadModel(cfg)

    def forward(self, idx):
        return self.lm(idx).logits


class _Conv1D(nn.Module):
    """GPT-2's projection: weight [in, out] (transposed against nn.Linear), y = x @ weight + bias."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out) * 0.02)
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class _GPT2Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = _Conv1D(d, 3 * d)
        self.c_proj = _Conv1D(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        return self.c_proj(a)


class _GPT2MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_fc = _Conv1D(d, 4 * d)
        self.c_proj = _Conv1D(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class _GPT2Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=1e-5)
        self.attn = _GPT2Attention(d, heads)
        self.ln_2 = nn.LayerNorm(d, eps=1e-5)
        self.mlp = _GPT2MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _GPT2Body(nn.Module):
    def __init__(self, layers: int, d: int, heads: int, vocab: int, context: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.h = nn.ModuleList(_GPT2Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, eps=1e-5)


class GPT2(nn.Module):
    """GPT-2 in plain torch, for machines without ``transformers``: GPT2LMHeadModel's parameters (names, shapes,
    order; the head tied to ``transformer.wte``), pre-LayerNorm blocks, tanh GELU, causal attention, no dropout.
    The defaults are GPT-2 124M (12 layers x 768, 12 heads, vocabulary 50257, context 1024: 148 tensors,
    124,439,808 elements).  ``forward(idx)`` returns the logits [batch, tokens, vocab]."""

    def __init__(self, layers: int = 12, d: int = 768, heads: int = 12, vocab: int = 50257, context: int = 1024):
        super().__init__()
        if d % heads:
            raise ValueError(f"GPT2: width {d} is not a multiple of the {heads} heads")
        self.transformer = _GPT2Body(layers, d, heads, vocab, context)
        self.context = context

    def forward(self, idx):
        if idx.shape[1] > self.context:
            raise ValueError(f"GPT2: {idx.shape[1]} tokens exceed the context of {self.context}")
        tr = self.transformer
        x = tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in tr.h:
            x = block(x)
        return tr.ln_f(x) @ tr.wte.weight.t()


def gpt2_lm(layers: int = 12, d: int = 768, heads: int = 12, vocab: int = 50257, context: int = 1024,
            prefer_transformers: bool = True) -> tuple[nn.Module, str]:
    """(a GPT-2 returning logits, where it came from): ``transformers``' GPT2LMHeadModel (dropout off) where that
    imports and ``prefer_transformers``, else :class:`GPT2`; both have the same parameters.  Defaults: 124M."""
    import importlib.util
    if prefer_transformers and importlib.util.find_spec("transformers") is not None:
        return GPT2Logits(layers, d, heads, vocab, context), "transformers GPT2LMHeadModel"
    return GPT2(layers, d, heads, vocab, context), "plain-torch GPT2 (operations/models.py)"


MODELS = ("mlp", "resnet50", "transformer", "tiny", "gpt2")


def make(name: str, batch: int, seed: int = 0, image: int = 64, layers: int = 4, width: int = 2500,
         count: int = 300, context: int = 64):
    """(model, example input of ``batch`` samples) for one of MODELS; the same seed gives the same model."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if name == "resnet50":
        return ResNet50(), torch.randn(batch, 3, image, image, generator=gen)
    if name == "transformer":
        model = Transformer(context=context)
        return model, torch.randint(0, model.tok.num_embeddings, (batch, context), generator=gen)
    if name == "tiny":
        return TinyTensors(count), torch.randn(batch, 64, generator=gen)
    if name == "gpt2":
        model = GPT2Logits(context=context)
        return model, torch.randint(0, model.lm.config.vocab_size, (batch, context), generator=gen)
    if name == "mlp":
        return mlp(layers, width), torch.randn(batch, width, generator=gen)
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


def describe(model: nn.Module) -> str:
    sizes = [p.numel() for p in model.parameters()]
    small = sum(1 for s in sizes if s < 4096)
    return f"{sum(sizes):,} parameters in {len(sizes)} tensors ({small} under 4096 elements)"
