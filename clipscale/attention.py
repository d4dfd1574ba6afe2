"""`model.attention: short`: the towers' self-attention of sequences of at most `MAX_TOKENS` tokens in
clipscale's Triton programs (`attention_programs.py` has the kernels and math): up to ONE_TILE_TOKENS
one program per (sample, head) holds the whole problem; beyond, one per (sample, head, block of
LOOP_BLOCK queries) loops over the key blocks.

Each open_clip `ResidualAttentionBlock`'s `nn.MultiheadAttention` becomes a `ShortAttention`: the
same module with the same parameters and state_dict keys (checkpoints load both ways with
open_clip), whose forward computes the packed projection, the attention (`short_attention`, a
custom operator with its own backward, which torch.compile calls as it is) and the output projection, as
nn.MultiheadAttention does with F.scaled_dot_product_attention. What it does not cover it hands to
nn.MultiheadAttention unchanged: longer sequences, a mask that is not the causal hint's, key
padding masks, dropout, attention weights asked for, cross-attention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
from torch import nn
from torch.library import custom_op

from clipscale.errors import UserError
from clipscale.losses.infcl.kernels import dot_precision
from clipscale.triton_modes import interpreting, programs

ONE_TILE_TOKENS = 64  # up to here one program holds a (sample, head) whole; beyond, it loops over key blocks
MAX_TOKENS = 256  # ViT-B/16's 197 image tokens; longer sequences stay with F.scaled_dot_product_attention
LOOP_BLOCK = 64  # the loop programs' query and key blocks
MAX_HEAD_DIM = 128  # beyond it, a program's [64, head_dim] float32 tiles outgrow its registers
LOG2_E = 1.4426950408889634


def token_block(tokens: int) -> int:
    """The one-tile programs' tile height for `tokens` (a power of two, at least 16: `tl.dot`'s least
    side); the loop programs' block (LOOP_BLOCK) for longer sequences."""
    for block in (16, 32, 64):
        if tokens <= block:  # comparisons, not next_power_of_2: a dynamic length gets a range guard
            return block
    if tokens <= MAX_TOKENS:
        return LOOP_BLOCK
    raise ValueError(f"short attention takes at most {MAX_TOKENS} tokens, got {tokens}")


def _blocks(tokens: int) -> int:
    """How many blocks of `token_block(tokens)` rows the sequence takes (1 up to ONE_TILE_TOKENS)."""
    return 1 if tokens <= ONE_TILE_TOKENS else -(-tokens // LOOP_BLOCK)


def _forward_outputs(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's output [b, s, width] and its rows' log-sum-exp (base 2) [b * heads, rows padded to blocks]."""
    b, s, width3 = qkv.shape
    lse_dtype = torch.float64 if qkv.dtype == torch.float64 else torch.float32
    padded = _blocks(s) * token_block(s)
    return qkv.new_empty((b, s, width3 // 3)), qkv.new_empty((b * heads, padded), dtype=lse_dtype)


def _launch(qkv: torch.Tensor, heads: int, causal: bool, direction: str):
    """A launch's program (one-tile or loop, `direction` fwd or bwd), grid (one program per sample,
    head and block), head width and compile-time settings."""
    b, s, width3 = qkv.shape
    head_dim, block = width3 // (3 * heads), token_block(s)
    settings = dict(CAUSAL=causal, BLOCK=block, HEAD_BLOCK=max(16, triton.next_power_of_2(head_dim)),
                    PREC=dot_precision(qkv.dtype, exact=False))
    device = programs("clipscale.attention_programs", interpreting())
    if s <= ONE_TILE_TOKENS:
        settings["num_warps"] = 4 if block <= 32 else 8
        return getattr(device, f"attention_{direction}_kernel"), (b * heads,), head_dim, settings
    settings["length_class"] = triton.next_power_of_2(s)  # the autotuner's key: one tuning for 65-128, one for 129-256
    return getattr(device, f"attention_{direction}_loop_kernel"), (b * heads, _blocks(s)), head_dim, settings


# Custom operators, opaque to torch.compile (Inductor calls them between its own kernels; CUDA graphs
# capture their launches), so that the same programs also run in Triton's interpreter on the CPU.
@custom_op("clipscale::short_attention_forward", mutates_args=())
def _forward(qkv: torch.Tensor, heads: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    kernel, grid, head_dim, settings = _launch(qkv, heads, causal, "fwd")
    out, lse = _forward_outputs(qkv, heads)
    kernel[grid](qkv, out, lse, qkv.shape[1], heads, head_dim, qkv.stride(0), qkv.stride(1), out.stride(0),
                 out.stride(1), LOG2_E / math.sqrt(head_dim), **settings)
    return out, lse


@custom_op("clipscale::short_attention_backward", mutates_args=())
def _backward(qkv: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor, heads: int,
              causal: bool) -> torch.Tensor:
    kernel, grid, head_dim, settings = _launch(qkv, heads, causal, "bwd")
    grad_qkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    kernel[grid](qkv, out, grad_out, lse, grad_qkv, qkv.shape[1], heads, head_dim, qkv.stride(0), qkv.stride(1),
                 out.stride(0), out.stride(1), grad_out.stride(0), grad_out.stride(1), 1 / math.sqrt(head_dim),
                 LOG2_E / math.sqrt(head_dim), **settings)
    return grad_qkv


@_forward.register_fake
def _forward_fake(qkv, heads, causal):
    return _forward_outputs(qkv, heads)


@_backward.register_fake
def _backward_fake(qkv, out, grad_out, lse, heads, causal):
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


def _save_for_backward(ctx, inputs, output):
    qkv, heads, causal = inputs
    out, lse = output
    ctx.save_for_backward(qkv, out, lse)
    ctx.heads, ctx.causal = heads, causal


def _attention_backward(ctx, grad_out, _grad_lse):
    qkv, out, lse = ctx.saved_tensors
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    return _backward(qkv, out, grad_out, lse, ctx.heads, ctx.causal), None, None


_forward.register_autograd(_attention_backward, setup_context=_save_for_backward)


def short_attention(qkv: torch.Tensor, heads: int, causal: bool = False) -> torch.Tensor:
    """Multi-head self-attention of a packed projection `qkv` [b, s, 3 * width] (queries, keys,
    values side by side; head h at columns h * head_dim of each), s <= MAX_TOKENS, scale
    1 / sqrt(head_dim): [b, s, width], as F.scaled_dot_product_attention over the heads."""
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    return _forward(qkv, heads, causal)[0]


def reference_attention(qkv: torch.Tensor, heads: int, causal: bool = False) -> torch.Tensor:
    """`short_attention` in plain PyTorch (the tests' reference, in float64)."""
    b, s, width3 = qkv.shape
    q, k, v = qkv.view(b, s, 3, heads, width3 // (3 * heads)).permute(2, 0, 3, 1, 4)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2).reshape(b, s, width3 // 3)


class ShortAttention(nn.MultiheadAttention):
    """nn.MultiheadAttention (batch_first, packed projection) with `short_attention` for the
    self-attention of sequences up to MAX_TOKENS; everything else as nn.MultiheadAttention."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        tokens = query.shape[1]
        covered = (query is key and key is value and query.dim() == 3 and key_padding_mask is None
                   and not need_weights and (attn_mask is None or is_causal)
                   and (self.dropout == 0.0 or not self.training) and tokens <= MAX_TOKENS
                   and self.head_dim <= MAX_HEAD_DIM)
        if not covered:
            return super().forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                   average_attn_weights, is_causal)
        qkv = F.linear(query, self.in_proj_weight, self.in_proj_bias)
        out = short_attention(qkv, self.num_heads, causal=is_causal)
        return F.linear(out, self.out_proj.weight, self.out_proj.bias), None


def _attention_blocks(model: nn.Module) -> list[nn.MultiheadAttention]:
    """The nn.MultiheadAttention modules of `model`'s open_clip ResidualAttentionBlocks that
    ShortAttention can stand in for (batch_first, one packed projection, no added bias)."""
    from open_clip.transformer import ResidualAttentionBlock

    return [block.attn for block in model.modules()
            if isinstance(block, ResidualAttentionBlock) and type(getattr(block, "attn", None)) is nn.MultiheadAttention
            and block.attn.batch_first and block.attn._qkv_same_embed_dim and block.attn.bias_k is None]


def use_short_attention(model: nn.Module, where_possible: bool = False) -> int:
    """model.attention: short. Make each open_clip ResidualAttentionBlock's nn.MultiheadAttention
    of `model` a ShortAttention in place (the same parameters, hooks and state_dict keys); the
    number of blocks changed. A model with none is refused, unless `where_possible` (model.attention:
    auto, which chooses short where the towers are compiled on a GPU: ViT-B/32 at 32,768 through
    train.py, 7,635 samples/s against sdpa's 6,293 (1.21x) on an H100,
    results/bench_e2e_h100_b32_32k_attention.json). Call before compiling and wrapping the model."""
    blocks = _attention_blocks(model)
    for attention in blocks:
        attention.__class__ = ShortAttention
    if not blocks and not where_possible:
        raise UserError("model.attention: short applies to open_clip's transformer towers (nn.MultiheadAttention "
                        "in ResidualAttentionBlock); this model has none: use model.attention: sdpa")
    return len(blocks)
