"""torch's fused RNN functions (`torch._VF.lstm`, `gru`, `rnn_tanh`, `rnn_relu`) for
`tfun.nn.RNN`, `LSTM` and `GRU`: every layer and direction of the stack in one call.

- Eagerly, `fused` calls the function directly (`call`), as `torch.nn.RNNBase.forward` does.
- Traced (`tfun.jit`, `torch.compile`), `fused` calls an opaque `torch.library` op; Dynamo
  would otherwise trace `torch._VF.lstm` into its per-step decomposition (measured on the CPU:
  a 613 s compile for a program that then ran 3x slower than the eager call). Only oneDNN's
  LSTM is taken when traced (`traced_pays`):
  - `tfun::lstm_onednn` where a gradient is wanted: oneDNN's layer kernel
    (`aten.mkldnn_rnn_layer`, what `torch._VF.lstm` runs on the CPU) for each layer and
    direction, returning what the backward needs beside the outputs (every layer's output and
    oneDNN's workspace for each layer and direction); `tfun::lstm_onednn_backward` runs
    oneDNN's layer backward (`aten.mkldnn_rnn_layer_backward`) over them in reverse, as
    torch's own autograd of the eager call does. A compiled training step runs each fused
    kernel once, as eagerly.
  - On CUDA with cuDNN, `tfun::rnn_cudnn` where a gradient is wanted (every mode: LSTM, GRU,
    RNN; float32, float16, bfloat16; no projections): cuDNN's whole-stack kernel
    (`aten._cudnn_rnn`, what `torch._VF.lstm` runs on CUDA) in training mode, returning its
    reserve space and flat weight buffer beside the outputs; `tfun::rnn_cudnn_backward` runs
    `aten._cudnn_rnn_backward` on them, as torch's own autograd of the eager call does.
    (Dynamo itself does not trace torch's RNN modules at all: `torch._dynamo.config.allow_rnn`
    is off, so a `torch.compile`d `torch.nn.LSTM` is a graph break around an eager call.)
  - `tfun::rnn_fused` for a forward alone (nothing requires grad, or grad mode is off).
- The backward ops have no derivative of their own: the layers take the scan wherever a
  derivative of a derivative is traced (see `tfun.nn._rnn._RNNBase._use_fused`).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, cast

import torch
from torch import _VF, Tensor

from .. import _compat, _context

# The dtypes torch's fused RNN functions run (forward and backward) per device type; anything
# else (other devices, complex, integer) takes the scan. On CUDA they run cuDNN (ATen's CUDA
# cells where cuDNN is off or refuses the input), as `torch.nn.LSTM` does. Neither oneDNN's nor
# cuDNN's backward has a derivative of its own, as for `torch.nn.LSTM`; the scan has one
# (`fused=False`, and every `torch.func` transform takes it).
FUSED_DTYPES = {
    "cpu": (torch.float32, torch.float64, torch.bfloat16, torch.float16),
    "cuda": (torch.float32, torch.float64, torch.bfloat16, torch.float16),
}

# The dtypes the traced CUDA path hands to cuDNN's kernels directly (`tfun::rnn_cudnn`).
CUDNN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# cuDNN wants the weights in one flat buffer. torch's layers keep theirs as views of one
# (`torch.nn.RNNBase.flatten_parameters`); tfun's keep one tensor per parameter, as every other
# module does (`.to()`, `load_state_dict` and optimizers need nothing special), so torch warns
# on each eager CUDA call that it copies them into one. That copy is of the weights alone (a
# few hundred KB for a layer of 256 units), next to a whole sequence's work.
_FLAT_WEIGHTS_WARNING = r"RNN module weights are not part of single contiguous chunk of memory"


def _onednn_lstm() -> tuple[bool, bool]:
    """Whether torch's CPU LSTM runs oneDNN's fused layer (`mkldnn_rnn_layer`): in float32, and
    in bfloat16 (where this CPU has it)."""
    on = bool(torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled())
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return on, on and bf16 is not None and bool(bf16())


# Dynamo runs it as plain Python (it reads torch's global flags) and keeps the answer.
_onednn_lstm._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _cudnn_on() -> bool:
    """Whether torch runs cuDNN (built with it, and `torch.backends.cudnn.enabled`)."""
    return bool(torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled)


_cudnn_on._dynamo_marked_constant = True  # type: ignore[attr-defined]


def autocast_dtype(mode: str, x: Tensor, has_proj: bool) -> torch.dtype | None:
    """The dtype torch's fused RNN function computes in under the active `torch.autocast`,
    where it is not `x`'s: the function's kernel is on autocast's lower-precision list, whose
    rule casts the input, the states and the weights, so `torch.nn`'s outputs and final states
    come out in autocast's dtype. That kernel is cuDNN's (`_cudnn_rnn`) on CUDA, every mode,
    and oneDNN's layer (`mkldnn_rnn_layer`) on the CPU, an LSTM without projections. None
    elsewhere (ATen's cells, which autocast casts op by op, as it does the scan's ops), for a
    float64 input (autocast leaves it alone) and without autocast.

    tfun's traced ops (`tfun::lstm_onednn`, `tfun::rnn_cudnn`, `tfun::rnn_fused`) have no
    autocast rule, and the scan's carry starts in the state's dtype: the layers cast to this
    dtype themselves (`_RNNBase._run`), so a compiled layer, or the scan, computes in the
    dtype `torch.nn` does (hunt 33, F2: they computed in float32)."""
    kind = x.device.type
    if kind not in ("cpu", "cuda") or not x.is_floating_point() or x.dtype == torch.float64:
        return None
    if not torch.is_autocast_enabled(kind):
        return None
    dtype = torch.get_autocast_dtype(kind)
    if dtype == x.dtype:
        return None
    if kind == "cuda":
        return dtype if _cudnn_on() else None
    return dtype if mode == "LSTM" and not has_proj and _onednn_lstm()[0] else None


def traced_pays(mode: str, x: Tensor, has_proj: bool) -> bool:
    """Whether a traced call takes the ops: only where torch's fused function is one fused
    kernel for the whole sequence: oneDNN's LSTM layer (CPU, float32 or bfloat16, no
    projections) and cuDNN's RNNs (CUDA, `CUDNN_DTYPES`, no projections). Elsewhere (GRU and
    RNN on the CPU, float64, projections: ATen's per-step cells) an op whose backward runs the
    forward again made a training step slower than the compiled scan (measured:
    benchmarks/RESULTS.md)."""
    if has_proj:
        return False
    if x.device.type == "cuda":
        return x.dtype in CUDNN_DTYPES and _cudnn_on()
    if mode != "LSTM" or x.device.type != "cpu":
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
    if x.is_cuda:
        # cuDNN refuses strided states ("rnn: hx is not contiguous", torch.nn.LSTM's error
        # too), and torch notes that it copies the weights into one buffer (silenced)
        h0 = h0.contiguous()
        c0 = c0.contiguous() if c0 is not None else None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_FLAT_WEIGHTS_WARNING)
            return _call(mode, x, h0, c0, weights, has_biases, num_layers, bidirectional, has_proj, train)
    return _call(mode, x, h0, c0, weights, has_biases, num_layers, bidirectional, has_proj, train)


def _call(
    mode: str, x: Tensor, h0: Tensor, c0: Tensor | None, weights: list[Tensor], has_biases: bool, num_layers: int,
    bidirectional: bool, has_proj: bool, train: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
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
        if x.is_cuda and not has_proj and _wants_grad(x, h0, c0, weights):
            out, h, c, _, _ = torch.ops.tfun.rnn_cudnn(mode, x, h0, c0, weights, has_biases, num_layers, bidirectional)
            return out, h, (c if mode == "LSTM" else None)
        if mode == "LSTM" and not has_proj and c0 is not None and _wants_grad(x, h0, c0, weights):
            out, h, c, _, _ = torch.ops.tfun.lstm_onednn(x, h0, c0, weights, has_biases, num_layers, bidirectional)
            return out, h, c
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
    """`(output, h_n, c_n)`; `c_n` is empty but for an LSTM (an op returns tensors only). A
    forward alone: it has no derivative (a traced call that wants one takes
    `tfun::lstm_onednn`), so differentiating it is torch's error, never a wrong gradient."""
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


def _wants_grad(x: Tensor, h0: Tensor, c0: Tensor | None, weights: list[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, h0, c0, *weights))


# oneDNN's LSTM in `aten.mkldnn_rnn_layer`'s `mode` argument (what torch's `_VF.lstm` passes)
_ONEDNN_LSTM = 2


def _layer_weights(weights: list[Tensor], k: int, has_biases: bool, hidden: int) -> list[Tensor]:
    """`(w_ih, w_hh, b_ih, b_hh)` of layer-and-direction `k` (zero biases without biases, as
    oneDNN's layer takes four weights)."""
    if has_biases:
        return [w.contiguous() for w in weights[4 * k : 4 * k + 4]]
    w_ih, w_hh = weights[2 * k], weights[2 * k + 1]
    zero = w_ih.new_zeros(4 * hidden)
    return [w_ih.contiguous(), w_hh.contiguous(), zero, zero]


def onednn_layers(
    x: Tensor, h0: Tensor, c0: Tensor, weights: list[Tensor], has_biases: bool, num_layers: int, bidirectional: bool
) -> tuple[Tensor, Tensor, Tensor, list[Tensor], list[Tensor]]:
    """The LSTM stack by oneDNN's layer kernel, keeping what its backward needs:
    `(output, h_n, c_n, the output of every layer but the last, one workspace per layer and
    direction)`. The kernels read their tensors as contiguous, whatever their strides (a
    strided one gives wrong numbers without an error), so every operand is made contiguous."""
    nd = 2 if bidirectional else 1
    hidden = h0.shape[-1]
    layer_in = x.contiguous()
    h0, c0 = h0.contiguous(), c0.contiguous()
    hy, cy, workspaces, layer_outs = [], [], [], []
    with torch.enable_grad():  # oneDNN returns its workspace only in grad mode
        for layer in range(num_layers):
            outs = []
            for d in range(nd):
                k = layer * nd + d
                out, h, c, ws = torch.ops.aten.mkldnn_rnn_layer(
                    layer_in, *_layer_weights(weights, k, has_biases, hidden), h0[k], c0[k], d == 1, [],
                    _ONEDNN_LSTM, hidden, num_layers, has_biases, bidirectional, False, True,
                )
                outs.append(out)
                hy.append(h)
                cy.append(c)
                workspaces.append(ws)
            layer_in = outs[0] if nd == 1 else torch.cat(outs, dim=2)
            if layer < num_layers - 1:
                layer_outs.append(layer_in)
    return layer_in, torch.stack(hy), torch.stack(cy), layer_outs, workspaces


def onednn_layers_backward(
    x: Tensor, h0: Tensor, c0: Tensor, weights: list[Tensor], has_biases: bool, num_layers: int, bidirectional: bool,
    out: Tensor, h_n: Tensor, c_n: Tensor, layer_outs: list[Tensor], workspaces: list[Tensor],
    grad_out: Tensor | None, grad_h: Tensor | None, grad_c: Tensor | None, grad_layer_outs: list[Tensor | None],
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """The cotangents of `(x, h0, c0, weights)` for those of `onednn_layers`' outputs (None:
    zero): oneDNN's layer backward for each layer and direction, last layer first."""
    nd = 2 if bidirectional else 1
    hidden = h0.shape[-1]
    x, h0, c0 = x.contiguous(), h0.contiguous(), c0.contiguous()
    # every layer and direction writes all of its weights' and states' cotangents below
    grad_w: list[Tensor] = list(weights)
    grad_h0: list[Tensor] = list(h0.unbind(0))
    grad_c0: list[Tensor] = list(c0.unbind(0))
    g_layer = grad_out if grad_out is not None else torch.zeros_like(out)
    outputs = [*layer_outs, out]
    with torch.enable_grad():
        for layer in reversed(range(num_layers)):
            if layer < num_layers - 1 and grad_layer_outs[layer] is not None:
                g_layer = g_layer + grad_layer_outs[layer]
            layer_in = x if layer == 0 else outputs[layer - 1].contiguous()
            g_dirs: list[Tensor] = []
            for d in range(nd):
                k = layer * nd + d
                sl = slice(d * hidden, (d + 1) * hidden)
                gx, gw_ih, gw_hh, gb_ih, gb_hh, gh0, gc0 = torch.ops.aten.mkldnn_rnn_layer_backward(
                    layer_in, *_layer_weights(weights, k, has_biases, hidden), h0[k], c0[k],
                    outputs[layer][..., sl].contiguous(), h_n[k], c_n[k], g_layer[..., sl].contiguous(),
                    grad_h[k] if grad_h is not None else None, grad_c[k] if grad_c is not None else None,
                    d == 1, _ONEDNN_LSTM, hidden, num_layers, has_biases, True, bidirectional, [], False, workspaces[k],
                )
                g_dirs.append(gx)
                per = 4 if has_biases else 2
                grad_w[per * k], grad_w[per * k + 1] = gw_ih, gw_hh
                if has_biases:
                    grad_w[per * k + 2], grad_w[per * k + 3] = gb_ih, gb_hh
                grad_h0[k], grad_c0[k] = gh0, gc0
            g_layer = g_dirs[0] if nd == 1 else g_dirs[0] + g_dirs[1]
    return g_layer, torch.stack(grad_h0), torch.stack(grad_c0), grad_w


@torch.library.custom_op("tfun::lstm_onednn", mutates_args=())
def _lstm_onednn(
    x: Tensor, h0: Tensor, c0: Tensor, weights: list[Tensor], has_biases: bool, num_layers: int, bidirectional: bool
) -> tuple[Tensor, Tensor, Tensor, list[Tensor], list[Tensor]]:
    """`onednn_layers` as an op (the last two outputs are for its backward)."""
    out, h, c, layer_outs, workspaces = onednn_layers(x, h0, c0, weights, has_biases, num_layers, bidirectional)
    return out.contiguous(), h, c, layer_outs, workspaces


@_lstm_onednn.register_fake
def _lstm_onednn_fake(
    x: Tensor, h0: Tensor, c0: Tensor, weights: list[Tensor], has_biases: bool, num_layers: int, bidirectional: bool
) -> tuple[Tensor, Tensor, Tensor, list[Tensor], list[Tensor]]:
    nd = 2 if bidirectional else 1
    hidden = h0.shape[-1]
    width = nd * hidden
    workspaces = []
    for layer in range(num_layers):
        n = _workspace_numel(x.shape[0], x.shape[1], x.shape[2] if layer == 0 else width, hidden, x.dtype)
        workspaces += [x.new_empty(n, dtype=torch.uint8) for _ in range(nd)]
    layer_outs = [x.new_empty(x.shape[0], x.shape[1], width) for _ in range(num_layers - 1)]
    return x.new_empty(x.shape[0], x.shape[1], width), _empty(h0), _empty(c0), layer_outs, workspaces


def _workspace_numel(steps: Any, batch: Any, features: Any, hidden: Any, dtype: torch.dtype) -> Any:
    """The size of oneDNN's workspace for one LSTM layer and direction (oneDNN sizes it itself;
    torch's own fake kernel says 0 bytes). Where the sizes are known it is asked of oneDNN by
    running the layer once on zeros, outside the fake mode (`_workspace_numel_of`, cached); with
    symbolic sizes it is a size known once the op has run (an unbacked size: such an op is
    kept in the graph even where its outputs go unused)."""
    dims = (steps, batch, features, hidden)
    if all(isinstance(d, int) for d in dims):
        return _workspace_numel_of(*dims, dtype)
    return torch.library.get_ctx().new_dynamic_size()


@functools.lru_cache(maxsize=256)
def _workspace_numel_of(steps: int, batch: int, features: int, hidden: int, dtype: torch.dtype) -> int:
    with _compat.outside_fake_mode(), torch.enable_grad():
        zeros = [torch.zeros(s, dtype=dtype) for s in ((steps, batch, features), (4 * hidden, features),
                                                       (4 * hidden, hidden), (4 * hidden,), (4 * hidden,),
                                                       (batch, hidden), (batch, hidden))]
        ws = torch.ops.aten.mkldnn_rnn_layer(*zeros, False, [], _ONEDNN_LSTM, hidden, 1, True, False, False, True)[3]
        return int(ws.numel())


@torch.library.custom_op("tfun::lstm_onednn_backward", mutates_args=())
def _lstm_onednn_backward(
    x: Tensor, h0: Tensor, c0: Tensor, weights: list[Tensor], has_biases: bool, num_layers: int, bidirectional: bool,
    out: Tensor, h_n: Tensor, c_n: Tensor, layer_outs: list[Tensor], workspaces: list[Tensor],
    grad_out: Tensor | None, grad_h: Tensor | None, grad_c: Tensor | None, grad_layer_outs: list[Tensor],
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """`onednn_layers_backward` as an op (`grad_layer_outs`: empty tensors for None)."""
    found = [g if g.numel() else None for g in grad_layer_outs]
    grads = onednn_layers_backward(
        x, h0, c0, weights, has_biases, num_layers, bidirectional, out, h_n, c_n, layer_outs, workspaces,
        grad_out, grad_h, grad_c, found,
    )
    # each in its input's layout, as the fake says (and as Inductor lays out an input's gradient)
    taken: set[int] = set()
    gx, gh0, gc0 = (_like(t, g, taken) for t, g in zip((x, h0, c0), grads[:3]))
    return gx, gh0, gc0, [_like(w, g, taken) for w, g in zip(weights, grads[3])]


def _like(t: Tensor, g: Tensor, taken: set[int]) -> Tensor:
    """`g` in `t`'s layout: `g` itself where it has it already (oneDNN's cotangents are
    contiguous, as a layer's tensors usually are) and no other output holds its memory, else
    a copy (an op's outputs must not share memory: two parameters' `.grad` would)."""
    ptr = g.untyped_storage().data_ptr()
    if g.stride() == t.stride() and g.dtype == t.dtype and g.storage_offset() == 0 and ptr and ptr not in taken:
        taken.add(ptr)
        return g
    return torch.empty_like(t).copy_(g)


@_lstm_onednn_backward.register_fake
def _lstm_onednn_backward_fake(
    x: Tensor, h0: Tensor, c0: Tensor, weights: list[Tensor], *rest: Any
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    return torch.empty_like(x), torch.empty_like(h0), torch.empty_like(c0), [torch.empty_like(w) for w in weights]


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    x, h0, c0, weights, has_biases, num_layers, bidirectional = inputs
    out, h_n, c_n, layer_outs, workspaces = output
    ctx.config = (has_biases, num_layers, bidirectional, len(weights), len(layer_outs))  # type: ignore[attr-defined]
    ctx.save_for_backward(x, h0, c0, *weights, out, h_n, c_n, *layer_outs, *workspaces)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor | None, grad_h: Tensor | None,
              grad_c: Tensor | None, grad_layer_outs: list[Tensor | None], grad_workspaces: Any) -> tuple:
    has_biases, num_layers, bidirectional, n_weights, n_layer_outs = ctx.config  # type: ignore[attr-defined]
    saved = list(ctx.saved_tensors)  # type: ignore[attr-defined]
    x, h0, c0 = saved[:3]
    weights = saved[3 : 3 + n_weights]
    out, h_n, c_n = saved[3 + n_weights : 6 + n_weights]
    layer_outs = saved[6 + n_weights : 6 + n_weights + n_layer_outs]
    workspaces = saved[6 + n_weights + n_layer_outs :]
    # (the layer outputs are the op's own: nothing outside reads them, so their cotangents are
    # zero or None; added all the same)
    g_layers = [g if g is not None else x.new_empty(0) for g in (grad_layer_outs or [None] * n_layer_outs)]
    gx, gh0, gc0, gw = torch.ops.tfun.lstm_onednn_backward(
        x, h0, c0, weights, has_biases, num_layers, bidirectional, out, h_n, c_n, layer_outs, workspaces,
        grad_out, grad_h, grad_c, g_layers,
    )
    return gx, gh0, gc0, gw, None, None, None


_lstm_onednn.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------
# cuDNN's RNNs, traced with a gradient (CUDA)
# ----------------------------------------------------------------------------------------


def _cudnn_config(mode: str, h0: Tensor, has_biases: bool) -> tuple[int, int, int]:
    """`(cuDNN's mode number, weight_stride0, hidden_size)` as `aten._cudnn_rnn` takes them:
    `weights` is in `_flat_weights_names` order, `weight_stride0` tensors per layer and
    direction (no projections here)."""
    from torch.backends.cudnn import rnn as cudnn_rnn

    return cudnn_rnn.get_cudnn_mode(mode), (4 if has_biases else 2), h0.shape[-1]


def cudnn_layers(
    mode: str, x: Tensor, h0: Tensor, c0: Tensor | None, weights: list[Tensor], has_biases: bool, num_layers: int,
    bidirectional: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The whole stack by cuDNN in training mode, keeping what its backward needs: `(output,
    h_n, c_n (empty but for an LSTM), cuDNN's reserve space, the flat weight buffer cuDNN
    copied the weights into)`."""
    return _cudnn_forward(mode, x, h0, c0, weights, has_biases, num_layers, bidirectional)


def _cudnn_forward(
    mode: str, x: Tensor, h0: Tensor, c0: Tensor | None, weights: list[Tensor], has_biases: bool, num_layers: int,
    bidirectional: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    cmode, stride0, hidden = _cudnn_config(mode, h0, has_biases)
    # torch's note that cuDNN copies the weights into one buffer, silenced. Called through
    # `torch._cudnn_rnn` (a binding that hands C++ warnings to Python as it returns), not
    # `torch.ops.aten._cudnn_rnn`, whose warnings surface at the outermost call from Python
    # (Dynamo's run of this op's fake kernel), past this filter: measured on an H100.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_FLAT_WEIGHTS_WARNING)
        out, h, c, reserve, buf = torch._cudnn_rnn(
            x.contiguous(), [w.contiguous() for w in weights], stride0, None, h0.contiguous(),
            c0.contiguous() if c0 is not None else None, cmode, hidden, 0, num_layers, False, 0.0, True,
            bidirectional, [], None,
        )
    return out, h, (c if c0 is not None else h.new_empty(0)), reserve, buf


def cudnn_layers_backward(
    mode: str, x: Tensor, h0: Tensor, c0: Tensor | None, weights: list[Tensor], has_biases: bool, num_layers: int,
    bidirectional: bool, out: Tensor, reserve: Tensor, buf: Tensor,
    grad_out: Tensor | None, grad_h: Tensor | None, grad_c: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor | None, list[Tensor]]:
    """The cotangents of `(x, h0, c0, weights)` for those of `cudnn_layers`' outputs (None:
    zero), by `aten._cudnn_rnn_backward`. cuDNN's backward writes into the reserve space, so it
    gets a copy (torch's own autograd does the same where the graph is kept)."""
    if grad_out is None and grad_h is None and grad_c is None:
        return (torch.zeros_like(x), torch.zeros_like(h0), torch.zeros_like(c0) if c0 is not None else None,
                [torch.zeros_like(w) for w in weights])
    cmode, stride0, hidden = _cudnn_config(mode, h0, has_biases)
    x, h0 = x.contiguous(), h0.contiguous()
    c0 = c0.contiguous() if c0 is not None else None
    grad_out = grad_out if grad_out is not None else torch.zeros_like(out)
    grad_h = grad_h if grad_h is not None else torch.zeros_like(h0)
    if c0 is not None and grad_c is None:
        grad_c = torch.zeros_like(c0)
    gx, gh0, gc0, gw = torch.ops.aten._cudnn_rnn_backward(
        x, [w.contiguous() for w in weights], stride0, buf, h0, c0, out, grad_out.contiguous(), grad_h.contiguous(),
        grad_c.contiguous() if (c0 is not None and grad_c is not None) else None, cmode, hidden, 0, num_layers,
        False, 0.0, True, bidirectional, [], None, reserve.clone(), [True, True, c0 is not None, True],
    )
    return gx, gh0, (gc0 if c0 is not None else None), list(gw)


@torch.library.custom_op("tfun::rnn_cudnn", mutates_args=())
def _rnn_cudnn(
    mode: str, x: Tensor, h0: Tensor, c0: Tensor | None, weights: list[Tensor], has_biases: bool, num_layers: int,
    bidirectional: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`cudnn_layers` as an op (the last two outputs are for its backward)."""
    return cudnn_layers(mode, x, h0, c0, weights, has_biases, num_layers, bidirectional)


@_rnn_cudnn.register_fake
def _rnn_cudnn_fake(
    mode: str, x: Tensor, h0: Tensor, c0: Tensor | None, weights: list[Tensor], has_biases: bool, num_layers: int,
    bidirectional: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    nd = 2 if bidirectional else 1
    reserve, buf = _cudnn_buffer_numels(mode, x, h0, weights, has_biases, num_layers, bidirectional)
    return (
        x.new_empty(x.shape[0], x.shape[1], nd * h0.shape[-1]), _empty(h0),
        _empty(c0) if c0 is not None else h0.new_empty(0),
        x.new_empty(reserve, dtype=torch.uint8), x.new_empty(buf),
    )


def _cudnn_buffer_numels(
    mode: str, x: Tensor, h0: Tensor, weights: list[Tensor], has_biases: bool, num_layers: int, bidirectional: bool
) -> tuple[Any, Any]:
    """The sizes of cuDNN's reserve space and flat weight buffer for this call (cuDNN sizes
    them itself; torch's own fake kernel says a reserve of 0 bytes). Where the sizes are known
    they are asked of cuDNN by running the stack once on zeros, outside the fake mode
    (`_cudnn_buffer_numels_of`, cached); with symbolic sizes they are sizes known once the op has
    run (unbacked sizes)."""
    dims = (x.shape[0], x.shape[1], x.shape[2], h0.shape[-1])
    if all(isinstance(d, int) for d in dims):
        shapes = tuple(tuple(w.shape) for w in weights)
        return _cudnn_buffer_numels_of(mode, *dims, shapes, has_biases, num_layers, bidirectional, x.dtype, x.device)
    ctx = torch.library.get_ctx()
    return ctx.new_dynamic_size(), ctx.new_dynamic_size()


@functools.lru_cache(maxsize=256)
def _cudnn_buffer_numels_of(
    mode: str, steps: int, batch: int, features: int, hidden: int, shapes: tuple, has_biases: bool, num_layers: int,
    bidirectional: bool, dtype: torch.dtype, device: torch.device,
) -> tuple[int, int]:
    nd = 2 if bidirectional else 1
    with _compat.outside_fake_mode(), torch.no_grad():
        new = functools.partial(torch.zeros, dtype=dtype, device=device)
        c0 = new(num_layers * nd, batch, hidden) if mode == "LSTM" else None
        _, _, _, reserve, buf = _cudnn_forward(
            mode, new(steps, batch, features), new(num_layers * nd, batch, hidden), c0, [new(s) for s in shapes],
            has_biases, num_layers, bidirectional,
        )
        return int(reserve.numel()), int(buf.numel())


@torch.library.custom_op("tfun::rnn_cudnn_backward", mutates_args=())
def _rnn_cudnn_backward(
    mode: str, x: Tensor, h0: Tensor, c0: Tensor | None, weights: list[Tensor], has_biases: bool, num_layers: int,
    bidirectional: bool, out: Tensor, reserve: Tensor, buf: Tensor,
    grad_out: Tensor | None, grad_h: Tensor | None, grad_c: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    """`cudnn_layers_backward` as an op (the cotangent of `c0` is empty without one). cuDNN
    returns the weights' cotangents as views of one flat buffer; each is copied out, in its
    weight's layout (an op's outputs must not share memory: two parameters' `.grad` would)."""
    gx, gh0, gc0, gw = cudnn_layers_backward(
        mode, x, h0, c0, weights, has_biases, num_layers, bidirectional, out, reserve, buf, grad_out, grad_h, grad_c
    )
    taken: set[int] = set()
    gx, gh0 = _like(x, gx, taken), _like(h0, gh0, taken)
    gc0 = _like(c0, gc0, taken) if (c0 is not None and gc0 is not None) else h0.new_empty(0)
    return gx, gh0, gc0, [torch.empty_like(w).copy_(g) for w, g in zip(weights, gw)]


@_rnn_cudnn_backward.register_fake
def _rnn_cudnn_backward_fake(
    mode: str, x: Tensor, h0: Tensor, c0: Tensor | None, weights: list[Tensor], *rest: Any
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    gc0 = torch.empty_like(c0) if c0 is not None else h0.new_empty(0)
    return torch.empty_like(x), torch.empty_like(h0), gc0, [torch.empty_like(w) for w in weights]


def _cudnn_setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    mode, x, h0, c0, weights, has_biases, num_layers, bidirectional = inputs
    out, _, _, reserve, buf = output
    ctx.config = (mode, has_biases, num_layers, bidirectional, len(weights), c0 is not None)  # type: ignore[attr-defined]
    ctx.save_for_backward(x, h0, c0 if c0 is not None else h0.new_empty(0), *weights, out, reserve, buf)


def _cudnn_backward(ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor | None, grad_h: Tensor | None,
                    grad_c: Tensor | None, grad_reserve: Any, grad_buf: Any) -> tuple:
    mode, has_biases, num_layers, bidirectional, n_weights, has_c0 = ctx.config  # type: ignore[attr-defined]
    saved = list(ctx.saved_tensors)  # type: ignore[attr-defined]
    x, h0, c0 = saved[0], saved[1], (saved[2] if has_c0 else None)
    weights = saved[3 : 3 + n_weights]
    out, reserve, buf = saved[3 + n_weights :]
    gx, gh0, gc0, gw = torch.ops.tfun.rnn_cudnn_backward(
        mode, x, h0, c0, weights, has_biases, num_layers, bidirectional, out, reserve, buf,
        grad_out, grad_h, grad_c if has_c0 else None,
    )
    return None, gx, gh0, (gc0 if has_c0 else None), gw, None, None, None


_rnn_cudnn.register_autograd(_cudnn_backward, setup_context=_cudnn_setup_context)
