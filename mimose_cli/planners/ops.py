"""The op cost vocabulary: which ops are compute-heavy (what a selective checkpoint keeps), the
kinds of the light ones, and a heavy op's work as a function of its shapes."""

import math

import torch

from mimose_cli.torch_private import tree_leaves

_aten = torch.ops.aten
COMPUTE_HEAVY_OPS = frozenset(
    op for op in (_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
                  _aten.convolution.default, _aten._scaled_dot_product_flash_attention.default,
                  _aten._scaled_dot_product_efficient_attention.default,
                  _aten._scaled_dot_product_cudnn_attention.default,
                  getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None) and
                  _aten._scaled_dot_product_flash_attention_for_cpu.default)
    if op is not None)
"""Ops whose outputs a ``selective`` block keeps: the matmuls, convolutions and fused attention
kernels (their recompute costs most per byte); pointwise ops, norms, softmax and dropout are
recomputed."""


LIGHT_OP_CLASSES = ("pointwise", "transcendental", "softmax", "random")
"""How fast an op other than a compute-heavy one writes its elements, by kind: arithmetic, copies
and norms (``pointwise``, the reference), activations built on exp, erf or tanh
(``transcendental``), a softmax, random numbers (dropout's mask). Their rates per element differ by
up to ten times on a CPU (a dropout's Bernoulli draw against an add), so a block's light work is
counted per kind (``light_op_class``) at each kind's rate (``choices.work_rates_ms``)."""
_LIGHT_CLASS = {
    **dict.fromkeys(("gelu", "silu", "tanh", "exp", "erf", "sigmoid", "log", "mish", "softplus", "elu",
                     "gelu_", "silu_", "tanh_", "exp_", "sigmoid_", "elu_"), "transcendental"),
    **dict.fromkeys(("_softmax", "_safe_softmax", "softmax", "_log_softmax", "log_softmax"), "softmax"),
    **dict.fromkeys(("bernoulli", "bernoulli_", "native_dropout", "rand", "rand_like", "uniform_", "normal_",
                     "randn", "randn_like"), "random"),
}


def light_op_class(func) -> str:
    """The kind (``LIGHT_OP_CLASSES``) of an op that is not compute-heavy, by its name."""
    return _LIGHT_CLASS.get(func.overloadpacket.__name__, "pointwise")


def heavy_op_work(func, args, out) -> tuple:
    """A compute-heavy op's work as ``(dims, factor, gemm)``: its floating-point operations are
    ``factor`` times the product of ``dims`` (its output's shape and the length each element is a
    sum over: a matmul's inner dimension, a convolution's input channels and kernel; an
    attention's key length and head dims, scores and values; a causal one does half), which grows
    with the input size as the op's time does where the output does not (attention times values:
    output ``B·L·d``, work ``B·L²·d``); ``gemm`` is the matmul it amounts to, ``(rows, inner, cols, dtype)``, None for
    an attention (whose inner length is the sequence's)."""
    first = out if isinstance(out, torch.Tensor) else next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
    name = func.overloadpacket.__name__
    if name in ("mm", "bmm", "addmm", "baddbmm"):
        inner = (args[0] if name in ("mm", "bmm") else args[1]).shape[-1]
        rows = first.numel() // first.shape[-1]
        return (*first.shape, inner), 2, (rows, inner, first.shape[-1], first.dtype)
    if name == "convolution":
        source, weight = (args[0], args[1]) if args[6] else (first, args[1])  # transposed: per input
        channels = weight.shape[1] if args[6] else weight.shape[0]
        inner = math.prod(weight.shape[2:]) * (weight.shape[1] if not args[6] else weight.shape[0] // args[8])
        rows = source.numel() // source.shape[1]
        return (*source.shape, *weight.shape[1:]), 2, (rows, inner, channels, first.dtype)
    query, key, value = args[:3]  # fused attention: scores (E) and the weighted sum of values (Ev)
    position = _IS_CAUSAL_ARG.get(name)
    causal = position is not None and len(args) > position and bool(args[position])
    return (*first.shape[:-1], key.shape[-2], query.shape[-1] + value.shape[-1]), 1 if causal else 2, None


_IS_CAUSAL_ARG = {"_scaled_dot_product_flash_attention": 4, "_scaled_dot_product_flash_attention_for_cpu": 4,
                  "_scaled_dot_product_efficient_attention": 6, "_scaled_dot_product_cudnn_attention": 6}
"""Where each fused attention kernel takes ``is_causal``: a causal kernel skips the keys past each
query, half the scores (torch's flop counter counts them all; the kernels' time halves)."""

