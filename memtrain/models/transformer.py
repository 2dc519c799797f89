"""Transformers: a GPT-style decoder (nanoGPT's shape) and a ViT (timm's VisionTransformer).

Both expose one transformer layer per chain segment (`gpt_chain`, `vit_chain`), so checkpoint
recomputes and synthetic cuts at layer boundaries as on every other model. Options shared by
both: `layers`, `width`, `heads`, `attention` (`math`: the explicit softmax(QK^T)V whose scores
are saved for backward; `sdpa`: torch's scaled_dot_product_attention, which picks a fused kernel
that keeps no s x s scores where the device has one) and `dropout` (attention and residual).

The decoder follows nanoGPT's model.py in the order of its operations, which is the order
Korthikanti et al. (2022) count activations in: `(q @ k^T) * scale`, causal mask, softmax,
dropout, `@ v`, with no fp32 upcast of the scores (bf16 scores stay bf16 under
trainer.precision=bf16-true).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from memtrain.errors import ConfigError, check_range
from memtrain.models.chain import Chain, chain_rule, children

ATTENTION = ("math", "sdpa")


def _check(name: str, layers: int, width: int, heads: int, attention: str,
           dropout: float) -> None:
    check_range("model.layers", layers, 1, 10_000)
    check_range("model.width", width, 1, 1 << 20)
    check_range("model.heads", heads, 1, width)
    check_range("model.dropout", dropout, 0, 1, hi_open=True)
    if width % heads:
        raise ConfigError(f"model.width={width} must be a multiple of model.heads={heads} "
                          f"(model {name}: each head gets width / heads channels)")
    if attention not in ATTENTION:
        raise ConfigError(f"model.attention={attention!r} is not one of {', '.join(ATTENTION)}")


# ---------------------------------------------------------------- GPT-style decoder


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (nanoGPT's CausalSelfAttention)."""

    def __init__(self, width: int, heads: int, context: int, dropout: float, attention: str):
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.heads, self.attention = heads, attention
        # True above the diagonal: the positions a token may not see. A buffer alive before any
        # step (not part of state_dict), sliced per call: the mask masked_fill saves for
        # backward is a view of it, not a new s x s tensor per layer.
        self.register_buffer("future", torch.ones(context, context, dtype=torch.bool).triu(1),
                             persistent=False)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, attention={self.attention}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C] -> [B, T, C]
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.attention == "sdpa":
            p = self.attn_dropout.p if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # [B, H, T, T]
            att = att.masked_fill(self.future[:t, :t], float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v  # [B, H, T, C / H]
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class FeedForward(nn.Module):
    """nanoGPT's MLP: Linear 4x, GELU, Linear back, dropout."""

    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class DecoderLayer(nn.Module):
    """One pre-LayerNorm transformer layer: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, width: int, heads: int, context: int, dropout: float, attention: str):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, context, dropout, attention)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = FeedForward(width, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TokenEmbedding(nn.Module):
    """Token plus learned position embeddings, then dropout: [B, T] ids -> [B, T, C]."""

    def __init__(self, vocab_size: int, context: int, width: int, dropout: float):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, width)
        self.wpe = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.wpe.num_embeddings:
            raise ValueError(f"sequence of {t} tokens is longer than the model's context "
                             f"{self.wpe.num_embeddings}")
        pos = torch.arange(t, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


class LMHead(nn.Module):
    """Final LayerNorm and the vocabulary projection, tied to the token embedding."""

    def __init__(self, width: int, wte: nn.Embedding):
        super().__init__()
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, wte.num_embeddings, bias=False)
        self.lm_head.weight = wte.weight  # tied (GPT-2, nanoGPT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C] -> [B, T, vocab]
        return self.lm_head(self.ln_f(x))


class GPT(nn.Module):
    """A decoder-only language model: token ids [B, T] -> next-token logits [B, T, vocab]."""

    task = "lm"  # what a method may ask of a model: next-token prediction, no classes

    def __init__(self, vocab_size: int, context: int, layers: int, width: int, heads: int,
                 dropout: float, attention: str):
        super().__init__()
        self.embed = TokenEmbedding(vocab_size, context, width, dropout)
        self.blocks = nn.Sequential(*(DecoderLayer(width, heads, context, dropout, attention)
                                      for _ in range(layers)))
        self.head = LMHead(width, self.embed.wte)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(idx)))


def _gpt(name: str, num_classes: int, input_shape: tuple[int, ...], layers: int, width: int,
         heads: int, attention: str, dropout: float, context: int | None) -> GPT:
    _check(name, layers, width, heads, attention, dropout)
    if len(input_shape) != 1:
        shape = "x".join(map(str, input_shape))
        raise ConfigError(f"model {name} is a language model: it reads token sequences, not "
                          f"{shape} inputs; use dataset=tokens or dataset=text")
    seq_len = input_shape[0]
    context = seq_len if context is None else context
    check_range("model.context", context, 1, 1 << 20)
    if seq_len > context:
        raise ConfigError(f"dataset.seq_len={seq_len} is longer than model.context={context}; "
                          f"raise model.context or lower dataset.seq_len")
    return GPT(num_classes, context, layers, width, heads, dropout, attention)


def gpt2_small(num_classes: int, input_shape: tuple[int, ...], layers: int = 12,
               width: int = 768, heads: int = 12, attention: str = "math",
               dropout: float = 0.0, context: int | None = 1024) -> GPT:
    """GPT-2 small (124M with GPT-2's 50257-token vocabulary): 12 layers, width 768, 12 heads,
    context 1024; the vocabulary is the dataset's (`dataset.vocab_size`)."""
    return _gpt("gpt2_small", num_classes, input_shape, layers, width, heads, attention,
                dropout, context)


def gpt_nano(num_classes: int, input_shape: tuple[int, ...], layers: int = 4,
             width: int = 128, heads: int = 4, attention: str = "math",
             dropout: float = 0.0, context: int | None = None) -> GPT:
    """A CPU-sized decoder of the same shape: 4 layers, width 128, 4 heads; context: the
    dataset's sequence length unless set."""
    return _gpt("gpt_nano", num_classes, input_shape, layers, width, heads, attention, dropout,
                context)


@chain_rule("memtrain.models.transformer.GPT")
def gpt_chain(model: nn.Module) -> Chain:
    """Each decoder layer is a segment; entry: the embeddings; head: final norm and logits."""
    return Chain(children("blocks", model.blocks), entry=model.embed, head=model.head)


# ---------------------------------------------------------------- ViT (timm)


def _vit(name: str, num_classes: int, input_shape: tuple[int, ...], patch_size: int,
         layers: int, width: int, heads: int, attention: str, dropout: float) -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    _check(name, layers, width, heads, attention, dropout)
    if len(input_shape) != 3:
        raise ConfigError(f"model {name} reads images, not token sequences; use an image "
                          f"dataset (synthetic, cifar10, fashion_mnist, ...)")
    c, h, w = input_shape
    if h != w:
        raise ConfigError(f"model {name} needs square images, got {h}x{w}")
    if patch_size < 1 or h % patch_size:
        raise ConfigError(f"model.patch_size={patch_size} must divide the image size {h}; "
                          f"choose a divisor of {h} or set dataset.image_size")
    model = _outside_fake_mode(functools.partial(
        VisionTransformer, img_size=h, patch_size=patch_size, in_chans=c,
        num_classes=num_classes, embed_dim=width, depth=layers, num_heads=heads, mlp_ratio=4.0,
        attn_drop_rate=dropout, proj_drop_rate=dropout, class_token=True, global_pool="token"))
    for block in model.blocks:  # timm reads this flag on every call
        block.attn.fused_attn = attention == "sdpa"
    return model


def _outside_fake_mode(build: Callable[[], nn.Module]) -> nn.Module:
    """`build()`, also under the GPU-free estimate's fake tensors: timm's constructor reads a
    value (`.item()` of its drop-path schedule), which fake tensors cannot give. There the model
    is built on the meta device outside fake mode (nothing allocated) and its storage made
    fake afterwards: the same shapes and dtypes, no values, as fake tensors are."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily() as fake:
        if fake is None:
            return build()
        with torch.device("meta"):
            model = build()
    device = torch.get_default_device()
    # Module.to_empty's own empty_like would hand the meta tensors to fake mode, which takes
    # only fake ones: a new empty tensor of each shape is made there instead
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def vit_b16(num_classes: int, input_shape: tuple[int, ...], patch_size: int = 16,
            layers: int = 12, width: int = 768, heads: int = 12, attention: str = "math",
            dropout: float = 0.0) -> nn.Module:
    """ViT-B/16: 12 layers, width 768, 12 heads, MLP 3072; 224 px -> 196 patches + class
    token."""
    return _vit("vit_b16", num_classes, input_shape, patch_size, layers, width, heads,
                attention, dropout)


def vit_tiny(num_classes: int, input_shape: tuple[int, ...], patch_size: int = 4,
             layers: int = 4, width: int = 128, heads: int = 4, attention: str = "math",
             dropout: float = 0.0) -> nn.Module:
    """A CPU-sized ViT: 4 px patches (32 px -> 64 patches + class token), 4 layers, width
    128, 4 heads."""
    return _vit("vit_tiny", num_classes, input_shape, patch_size, layers, width, heads,
                attention, dropout)


class ViTEntry(nn.Module):
    """timm VisionTransformer's forward before its blocks (patch embedding, class token and
    position embedding, patch dropout, pre-norm) as one module sharing the model's parameters."""

    def __init__(self, vit: nn.Module):
        super().__init__()
        self.patch_embed, self.pos_drop = vit.patch_embed, vit.pos_drop
        self.patch_drop, self.norm_pre = vit.patch_drop, vit.norm_pre
        self.cls_token, self.pos_embed = vit.cls_token, vit.pos_embed  # the same Parameters
        object.__setattr__(self, "_vit", vit)  # for timm's own _pos_embed; not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, H, W] -> [B, N, width]
        x = self._vit._pos_embed(self.patch_embed(x))
        return self.norm_pre(self.patch_drop(x))


class ViTHead(nn.Module):
    """The final norm, class-token pooling and classifier (timm's norm + forward_head)."""

    def __init__(self, vit: nn.Module):
        super().__init__()
        self.norm, self.fc_norm = vit.norm, vit.fc_norm
        self.head_drop, self.head = vit.head_drop, vit.head
        object.__setattr__(self, "_vit", vit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, N, width] -> [B, classes]
        return self._vit.forward_head(self.norm(x))


@chain_rule("timm.models.vision_transformer.VisionTransformer")
def vit_chain(model: nn.Module) -> Chain:
    """Each transformer block is a segment; entry: patches and position embedding; head: final
    norm, class token and classifier."""
    return Chain(children("blocks", model.blocks), entry=ViTEntry(model), head=ViTHead(model))
