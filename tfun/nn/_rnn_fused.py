"""torch's fused RNN functions (`torch._VF.lstm`, `gru`, `rnn_tanh`, `rnn_relu`) for
`tfun.nn.RNN`, `LSTM` and `GRU`: every layer and direction of the stack in one call.

- Eagerly, `fused` calls the function directly (`call`), as `torch.nn.RNNBase.forward` does.
- Traced (`tfun.jit`, `torch.compile`), `fused` calls one opaque `torch.library` op,
  `tfun::rnn_fused`. Dynamo would otherwise trace `torch._VF.lstm` into its per-step
  decomposition: measured on the CPU, a 613 s compile for a program that then ran 3x slower
  than the eager call. The op's forward runs the fused function without keeping anything for
  a backward; its backward, `tfun::rnn_fused_backward`, runs the fused function again under
  autograd and pulls the cotangents back through it (a training step costs one forward more
  than eagerly; it saves only the op's inputs, where the scan saves every step).
- The backward op has no derivative of its own: the layers take the scan wherever a
  derivative of a derivative is traced (see `tfun.nn._rnn._RNNBase._use_fused`).
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
from torch import _VF, Tensor

from .. import _compat, _context

# The dtypes torch's fused RNN functions run (forward and backward) per device type; anything
# else (other devices, complex, integer) takes the scan. CUDA (cuDNN) is left out until it is
# measured on a GPU: cuDNN wants the weights in one flat buffer (`flatten_parameters`, a no-op
# here) and has no double backward, where the scan has one.
FUSED_DTYPES = {
    "cpu": (torch.float32, torch.float64, torch.bfloat16, torch.float16),
}


def _onednn_lstm() -> tuple[bool, bool]:
    """Whether torch's CPU LSTM runs oneDNN's fused layer (`mkldnn_rnn_layer`): in float32, and
    in bfloat16 (where this CPU has it)."""
    on = bool(torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled())
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return on, on and bf16 is not None and bool(bf16())


# Dynamo runs it as plain Python (it reads torch's global flags) and keeps the answer.
_onednn_lstm._dynamo_marked_constant = True  # type: ignore[attr-defined]


def traced_pays(mode: str, x: Tensor, has_proj: bool) -> bool:
    """Whether a traced call takes the op: only where torch's fused function is one fused
    kernel for the whole sequence, oneDNN's LSTM layer (CPU, float32 or bfloat16, no
    projections). Elsewhere (GRU and RNN, float64, projections: ATen's per-step cells) the
    op's backward, which runs the forward again, made a training step slower than the
    compiled scan (measured: benchmarks/RESULTS.md)."""
    if mode != "LSTM" or has_proj or x.device.type != "cpu":
        return False
    on, bf16 = _onednn_lstm()
    return (on and x.dtype == torch.float32) or (bf16 and x.dtype == torch.bfloat16)


def call(
    mode: str,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    weights: list[Tensor],
    has_biases: bool,
    num_layers: int,
    bidirectional: bool,
    has_proj: bool,
    train: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Every layer and direction in one call of torch's fused RNN function (what
    `torch.nn.RNNBase.forward` calls). `x`: (T, B, F); `weights`: `_flat_weights_names` order.

    Called only with no dropout active, so dropout is 0. `train` only selects whether the
    kernel keeps what its backward needs (cuDNN refuses a backward of an inference-mode
    forward).
    """
    if mode == "LSTM":
        hx = (h0, cast(Tensor, c0))
        if not has_proj:
            out, h, c = _VF.lstm(x, hx, weights, has_biases, num_layers, 0.0, train, bidirectional, False)
            return out, h, c
        # with projections torch's CPU kernel warns that oneDNN has none and runs ATen's cells:
        # a note about torch's own choice of kernel, not about the caller's code
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"LSTM with projections is not supported with oneDNN")
            out, h, c = _VF.lstm(x, hx, weights, has_biases, num_layers, 0.0, train, bidirectional, False)
        return out, h, c
    fn = {"GRU": _VF.gru, "RNN_TANH": _VF.rnn_tanh, "RNN_RELU": _VF.rnn_relu}[mode]
    out, h = fn(x, h0, weights, has_biases, num_layers, 0.0, train, bidirectional, False)
    return out, h, None


def fused(
    mode: str,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    weights: list[Tensor],
    has_biases: bool,
    num_layers: int,
    bidirectional: bool,
    has_proj: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The fused stack: `call` eagerly (keeping what a backward needs whenever autograd
    records, so an `eval()` layer is differentiable as on the scan path), the op when traced."""
    if _context.is_tracing():
        out, h, c = torch.ops.tfun.rnn_fused(mode, x, h0, c0, weights, has_biases, num_layers, bidirectional, has_proj)
        return out, h, (c if mode == "LSTM" else None)
    return call(mode, x, h0, c0, weights, has_biases, num_layers, bidirectional, has_proj, torch.is_grad_enabled())


# ----------------------------------------------------------------------------------------
# The ops
# ----------------------------------------------------------------------------------------


def _empty(t: Tensor) -> Tensor:
    """A contiguous tensor of `t`'s shape, dtype and device (what the ops return)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


@torch.library.custom_op("tfun::rnn_fused", mutates_args=())
def _rnn_fused(
    mode: str,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    weights: list[Tensor],
    has_biases: bool,
    num_layers: int,
    bidirectional: bool,
    has_proj: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """`(output, h_n, c_n)`; `c_n` is empty but for an LSTM (an op returns tensors only)."""
    out, h, c = call(mode, x, h0, c0, weights, has_biases, num_layers, bidirectional, has_proj, False)
    return out.contiguous(), h.contiguous(), (c.contiguous() if c is not None else h.new_empty(0))


# The fakes (shapes only) read the inputs they need; the configuration follows as `*config`.
@_rnn_fused.register_fake
def _rnn_fused_fake(
    mode: str, x: Tensor, h0: Tensor, c0: Tensor | None, weights: list[Tensor], has_biases: bool, num_layers: int,
    bidirectional: bool, *config: Any,
) -> tuple[Tensor, Tensor, Tensor]:
    directions = 2 if bidirectional else 1
    out = x.new_empty(x.shape[0], x.shape[1], directions * h0.shape[-1])
    return out, _empty(h0), (_empty(c0) if c0 is not None else h0.new_empty(0))


@torch.library.custom_op("tfun::rnn_fused_backward", mutates_args=())
def _rnn_fused_backward(
    mode: str,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    weights: list[Tensor],
    has_biases: bool,
    num_layers: int,
    bidirectional: bool,
    has_proj: bool,
    grad_out: Tensor | None,
    grad_h: Tensor | None,
    grad_c: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """The cotangents of `(x, h0, c0, weights)` (`c0`'s empty but for an LSTM) for those of
    `tfun::rnn_fused`'s outputs (None: zero): the fused forward again, under autograd."""
    with _compat.autograd_inside_op(), torch.enable_grad():
        xs = x.detach().requires_grad_()
        h0s = h0.detach().requires_grad_()
        c0s = c0.detach().requires_grad_() if c0 is not None else None
        ws = [w.detach().requires_grad_() for w in weights]
        out, h, c = call(mode, xs, h0s, c0s, ws, has_biases, num_layers, bidirectional, has_proj, True)
        pairs = [(o, g) for o, g in ((out, grad_out), (h, grad_h), (c, grad_c)) if o is not None and g is not None]
        inputs = [xs, h0s, *([c0s] if c0s is not None else []), *ws]
        found: tuple[Tensor | None, ...] = (None,) * len(inputs)
        if pairs:
            found = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs], allow_unused=True)
    # each in its input's layout, as the fake says (and as Inductor lays out an input's gradient)
    grads = [torch.empty_like(t).copy_(t.new_zeros(()) if g is None else g) for t, g in zip(inputs, found)]
    gx, gh0 = grads[0], grads[1]
    if c0s is None:
        return gx, gh0, h0.new_empty(0), grads[2:]
    return gx, gh0, grads[2], grads[3:]


@_rnn_fused_backward.register_fake
def _rnn_fused_backward_fake(
    mode: str, x: Tensor, h0: Tensor, c0: Tensor | None, weights: list[Tensor], *config_and_grads: Any
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    gc0 = torch.empty_like(c0) if c0 is not None else h0.new_empty(0)
    return torch.empty_like(x), torch.empty_like(h0), gc0, [torch.empty_like(w) for w in weights]


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    mode, x, h0, c0, weights, has_biases, num_layers, bidirectional, has_proj = inputs
    ctx.config = (mode, has_biases, num_layers, bidirectional, has_proj)  # type: ignore[attr-defined]
    ctx.has_c = c0 is not None  # type: ignore[attr-defined]
    ctx.save_for_backward(x, h0, *([c0] if c0 is not None else []), *weights)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor | None, grad_h: Tensor | None,
              grad_c: Tensor | None) -> tuple:
    mode, has_biases, num_layers, bidirectional, has_proj = ctx.config  # type: ignore[attr-defined]
    saved = ctx.saved_tensors  # type: ignore[attr-defined]
    x, h0 = saved[0], saved[1]
    c0 = saved[2] if ctx.has_c else None  # type: ignore[attr-defined]
    weights = list(saved[3:] if ctx.has_c else saved[2:])  # type: ignore[attr-defined]
    if c0 is None:
        grad_c = None
    gx, gh0, gc0, gw = torch.ops.tfun.rnn_fused_backward(
        mode, x, h0, c0, weights, has_biases, num_layers, bidirectional, has_proj, grad_out, grad_h, grad_c
    )
    return None, gx, gh0, (gc0 if c0 is not None else None), gw, None, None, None, None


_rnn_fused.register_autograd(_backward, setup_context=_setup_context)
