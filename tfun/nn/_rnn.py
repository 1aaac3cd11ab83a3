"""Drop-in replacements for `torch.nn.RNN`, `LSTM`, `GRU` and their cells, built on `tfun.lax.scan`.

Each layer and direction runs one `tfun.lax.scan` over time. As cuDNN does, the input
projection `x_t W_ih^T + b_ih` of every step is computed before the scan in one matrix
multiply; the scan body only applies the recurrent weight. Parameter names, shapes,
registration order and initialization are torch's, so `state_dict`s move between
`torch.nn.LSTM` and `tfun.nn.LSTM` (strict) and seeded initialization gives the same weights.

Fused path (`tfun.nn._rnn_fused`): `RNN`, `LSTM` and `GRU` (not the cells) called eagerly,
outside any `torch.func` transform and forward-AD dual level, with no inter-layer dropout
active, on a CPU or CUDA floating dtype, call torch's own fused functions instead
(`torch._VF.lstm`, `gru`, `rnn_tanh`, `rnn_relu`, as `torch.nn.RNNBase.forward` does:
oneDNN's `mkldnn_rnn_layer` or ATen's C++ cells on the CPU, cuDNN on CUDA), since a
Python-level scan step costs several dispatches per time step. Traced (`tfun.jit`,
`torch.compile`), an LSTM on oneDNN (CPU, float32 or bfloat16, no projections) calls
oneDNN's layer kernels through opaque ops (`tfun::lstm_onednn` with its backward op), and
every mode on CUDA (float32, float16, bfloat16, no projections) cuDNN's (`tfun::rnn_cudnn`
with its backward op), or `tfun::rnn_fused` for a forward alone, under
the same conditions and not inside a loop body or a derivative that
is differentiated again; every other traced call (`torch.export` included) runs the scan,
which lowers to torch's scan higher-order op and has every transform's rules. `fused=False`
always runs the scan. Both paths share `_prepare` (tfun's argument errors) and compute the
same function.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _compat, _context, lax
from .._errors import ArgumentValueError
from ..lax import _hop
from . import _rnn_fused
from ._common import check_input, check_state, check_tensor

_GATES = {"RNN_TANH": 1, "RNN_RELU": 1, "LSTM": 4, "GRU": 3}

def _out(h: Tensor) -> Tensor:
    """The per-step output `h`: a copy when compiling, since scan's body outputs may not alias each other."""
    return h.clone() if _context.is_tracing() else h


def _autocast_state_dtype(h: Tensor) -> Tensor:
    """`h` in the dtype the step returns it in under `torch.autocast`: the recurrent product
    (`addmm`, `mm`: autocast's lower-precision list) makes a float32 state bfloat16 (or the
    autocast dtype) from the first step, so a scan's carry must start there (hunt 33, F1:
    `RNN` and a projected `LSTM` were refused, where `torch.nn` computes in that dtype too).
    Unchanged without autocast and for dtypes autocast leaves alone."""
    kind = h.device.type
    if h.dtype == torch.float32 and torch.is_autocast_enabled(kind):
        return h.to(torch.get_autocast_dtype(kind))
    return h


def _autocast_input_dtype(x: Any, param_dtype: torch.dtype) -> torch.dtype | None:
    """The input's dtype where the layer takes it although it is not its parameters': under
    `torch.autocast` for the input's device, an input in autocast's dtype beside float32
    parameters (autocast casts them in each product, and `torch.nn`'s layers take such an
    input). None otherwise: the input must then have the parameters' dtype."""
    if not isinstance(x, Tensor) or param_dtype != torch.float32 or x.dtype == param_dtype:
        return None
    kind = x.device.type
    if kind not in ("cpu", "cuda") or not torch.is_autocast_enabled(kind):
        return None
    return x.dtype if x.dtype == torch.get_autocast_dtype(kind) else None


def _state_dtype(h: Any, param_dtype: torch.dtype, autocast_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype `check_state` asks of a given state: the parameters', or either of them and
    autocast's where the input is in autocast's dtype (see `_autocast_input_dtype`)."""
    if autocast_dtype is not None and isinstance(h, Tensor) and h.dtype in (param_dtype, autocast_dtype):
        return None
    return param_dtype


def _scan_direction(
    mode: str,
    x: Tensor,
    h0: Tensor,
    c0: Tensor | None,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
    w_hr: Tensor | None,
    reverse: bool,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One layer, one direction. `x`: (T, B, F). Returns (outputs (T, B, H_out), h_T, c_T)."""
    if mode != "GRU" and b_ih is not None and b_hh is not None:
        # one bias: b_ih + b_hh enter the same sum (outside GRU's reset gate). Two, each added to
        # the projection, make two identical reductions of its gradient, which Inductor's CPU
        # code for half precision declares twice ("conflicting declaration ... tmp_acc0_vec":
        # torch 2.11 - 2.14, bfloat16 / float16 training under tfun.jit)
        xp = F.linear(x, w_ih, b_ih + b_hh)  # (T, B, gates * H), all steps at once
        b_hh = None
    else:
        xp = F.linear(x, w_ih, b_ih)
    w_hh_t = w_hh.t()
    if mode == "GRU":

        def gru_step(h: Tensor, xt: Tensor) -> tuple[Tensor, Tensor]:
            gh = F.linear(h, w_hh, b_hh)
            x_r, x_z, x_n = xt.chunk(3, 1)
            h_r, h_z, h_n = gh.chunk(3, 1)
            r = torch.sigmoid(x_r + h_r)
            z = torch.sigmoid(x_z + h_z)
            n = torch.tanh(x_n + r * h_n)
            h = n + z * (h - n)  # == (1 - z) * n + z * h
            return h, _out(h)

        h, ys = lax.scan(gru_step, h0, xp, reverse=reverse)
        return ys, h, None

    if b_hh is not None:
        xp = xp + b_hh
    if mode == "LSTM":
        w_hr_t = w_hr.t() if w_hr is not None else None

        def lstm_step(carry: tuple[Tensor, Tensor], xt: Tensor) -> tuple[tuple[Tensor, Tensor], Tensor]:
            h, c = carry
            g = torch.addmm(xt, h, w_hh_t)
            # one sigmoid over all four gates (the g gate's is unused) costs less than three
            # small ones: each op is a dispatch, forward and backward
            i, f, _, o = torch.sigmoid(g).chunk(4, 1)
            # the g gate by chunk, not by a slice with a closed-over size: under tfun.jit's
            # dynamic shapes that size is a SymInt expression (hidden // 4), which torch's
            # scan cannot take as a lifted input
            c = torch.addcmul(f * c, i, torch.tanh(g.chunk(4, 1)[2]))
            h = o * torch.tanh(c)
            if w_hr_t is not None:
                h = h.mm(w_hr_t)
            return (h, c), _out(h)

        if w_hr_t is not None:  # the projected state is a product's output (the cell state is not)
            h0 = _autocast_state_dtype(h0)
        (h, c), ys = lax.scan(lstm_step, (h0, c0), xp, reverse=reverse)
        return ys, h, c

    act = torch.tanh if mode == "RNN_TANH" else torch.relu

    def rnn_step(h: Tensor, xt: Tensor) -> tuple[Tensor, Tensor]:
        h = act(torch.addmm(xt, h, w_hh_t))
        return h, _out(h)

    h, ys = lax.scan(rnn_step, _autocast_state_dtype(h0), xp, reverse=reverse)
    return ys, h, None


class _RNNBase(nn.Module):
    """Shared machinery of `RNN`, `LSTM` and `GRU` (torch's `RNNBase` contract)."""

    _layer_name = "tfun.nn.RNNBase"

    def __init__(
        self,
        mode: str,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        device: Any = None,
        dtype: Any = None,
        *,
        fused: bool = True,
    ) -> None:
        super().__init__()
        name = self._layer_name
        factory = {"device": device, "dtype": dtype}
        if not isinstance(dropout, numbers.Number) or isinstance(dropout, bool) or not 0 <= dropout <= 1:
            raise ArgumentValueError(
                f"{name}: dropout must be a number in [0, 1] giving the probability of an element to be zeroed, "
                f"but got {dropout!r}."
            )
        for arg, val in (("input_size", input_size), ("hidden_size", hidden_size), ("num_layers", num_layers)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ArgumentValueError(f"{name}: {arg} must be a positive int, but got {val!r}.")
        if not isinstance(proj_size, int) or isinstance(proj_size, bool) or proj_size < 0:
            raise ArgumentValueError(f"{name}: proj_size must be a non-negative int, but got {proj_size!r}.")
        if proj_size >= hidden_size:
            raise ArgumentValueError(
                f"{name}: proj_size must be smaller than hidden_size, but got proj_size={proj_size} and "
                f"hidden_size={hidden_size}."
            )
        if proj_size and mode != "LSTM":
            raise ArgumentValueError(f"{name}: proj_size is supported only by LSTM.")
        if dropout > 0 and num_layers == 1:
            warnings.warn(
                "dropout option adds dropout after all but last recurrent layer, so non-zero dropout expects "
                f"num_layers greater than 1, but got dropout={dropout} and num_layers={num_layers}",
                stacklevel=3,
            )
        self.mode = mode
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.bias = bias
        self.batch_first = batch_first
        self.dropout = float(dropout)
        self.bidirectional = bidirectional
        self.proj_size = proj_size
        self.fused = bool(fused)
        num_directions = 2 if bidirectional else 1
        gate_size = _GATES[mode] * hidden_size
        real_hidden = proj_size if proj_size > 0 else hidden_size

        self._flat_weights_names: list[str] = []
        self._all_weights: list[list[str]] = []
        for layer in range(num_layers):
            for direction in range(num_directions):
                layer_input = input_size if layer == 0 else real_hidden * num_directions
                suffix = "_reverse" if direction == 1 else ""
                shapes = [("weight_ih", (gate_size, layer_input)), ("weight_hh", (gate_size, real_hidden))]
                if bias:
                    shapes += [("bias_ih", (gate_size,)), ("bias_hh", (gate_size,))]
                if proj_size > 0:
                    shapes.append(("weight_hr", (proj_size, hidden_size)))
                names = []
                for base, shape in shapes:
                    pname = f"{base}_l{layer}{suffix}"
                    setattr(self, pname, nn.Parameter(torch.empty(shape, **factory)))
                    names.append(pname)
                self._flat_weights_names.extend(names)
                self._all_weights.append(names)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw every parameter from U(-1/sqrt(hidden_size), 1/sqrt(hidden_size)), as torch does."""
        stdv = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0
        for weight in self.parameters():
            nn.init.uniform_(weight, -stdv, stdv)

    def flatten_parameters(self) -> None:
        """No-op, for compatibility with code written for `torch.nn.RNNBase` (cuDNN only)."""

    @property
    def all_weights(self) -> list[list[nn.Parameter]]:
        return [[getattr(self, n) for n in names] for names in self._all_weights]

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.proj_size != 0:
            s += f", proj_size={self.proj_size}"
        if self.num_layers != 1:
            s += f", num_layers={self.num_layers}"
        if self.bias is not True:
            s += f", bias={self.bias}"
        if self.batch_first is not False:
            s += f", batch_first={self.batch_first}"
        if self.dropout != 0:
            s += f", dropout={self.dropout}"
        if self.bidirectional is not False:
            s += f", bidirectional={self.bidirectional}"
        if not self.fused:
            s += ", fused=False"
        return s

    def __setstate__(self, state: dict[str, Any]) -> None:
        # layers pickled before `fused` existed take the default
        state.setdefault("fused", True)
        super().__setstate__(state)

    # -- forward ---------------------------------------------------------------------------

    def _prepare(self, input: Any, hx: Any) -> tuple[Tensor, bool, Tensor | None, Tensor | None]:
        name = self._layer_name
        check_tensor(name, "input", input)
        dtype = self.weight_ih_l0.dtype
        # under autocast, an input (and states) in autocast's dtype beside float32 parameters,
        # which autocast casts as torch.nn's layers take them (hunt 33, F7)
        autocast_dtype = _autocast_input_dtype(input, dtype)
        layout = "(batch, seq, input_size)" if self.batch_first else "(seq, batch, input_size)"
        input = check_input(name, input, ndims=(2, 3), features=self.input_size,
                            dtype=dtype if autocast_dtype is None else None,
                            layout=f"{layout} or unbatched (seq, input_size)")
        batched = input.dim() == 3
        x = input
        if not batched:
            x = x.unsqueeze(1)
        elif self.batch_first:
            x = x.transpose(0, 1)
        batch = x.shape[1]
        nd = 2 if self.bidirectional else 1
        real_hidden = self.proj_size if self.proj_size > 0 else self.hidden_size
        h_shape = (self.num_layers * nd, batch, real_hidden) if batched else (self.num_layers * nd, real_hidden)
        c_shape = (self.num_layers * nd, batch, self.hidden_size) if batched else (self.num_layers * nd, self.hidden_size)
        h0 = c0 = None
        if hx is not None:
            if self.mode == "LSTM":
                if not isinstance(hx, (tuple, list)) or len(hx) != 2:
                    raise ArgumentValueError(
                        f"{name}: hx must be a tuple (h_0, c_0) of tensors of shapes {h_shape} and {c_shape}, "
                        f"but got {type(hx).__name__}."
                    )
                h0 = check_state(name, "h_0", hx[0], h_shape, _state_dtype(hx[0], dtype, autocast_dtype))
                c0 = check_state(name, "c_0", hx[1], c_shape, _state_dtype(hx[1], dtype, autocast_dtype))
            else:
                h0 = check_state(name, "hx", hx, h_shape, _state_dtype(hx, dtype, autocast_dtype))
            if not batched:
                h0 = h0.unsqueeze(1)
                c0 = c0.unsqueeze(1) if c0 is not None else None
        return x, batched, h0, c0

    def _use_fused(self, x: Tensor, h0: Tensor | None, c0: Tensor | None) -> list[Tensor] | None:
        """The flat weights for torch's fused kernels (`_fused`) where this call may run them,
        else None: see the module docstring."""
        if not self.fused:
            return None
        if self.dropout > 0 and self.training:  # the scan draws the dropout masks
            return None
        if _context.is_tracing():
            # traced: the fused op (`_rnn_fused`), but not for torch.export (a portable graph
            # of aten ops), inside a torch.func transform (the op has no batching or
            # forward-mode rule), inside a loop body or branch (torch runs HOP bodies with
            # autograd off), nor inside a derivative that is differentiated again (the op's
            # backward has no derivative; there the scan's loops are unrolled)
            if _compat.is_exporting() or _context.functorch_active() or _hop.in_body() or _hop.unrolled_steps():
                return None
            if not _rnn_fused.traced_pays(self.mode, x, self.proj_size > 0):
                return None
        elif _context.functorch_active() or _compat.forward_ad_level_active():
            return None
        if x.dtype not in _rnn_fused.FUSED_DTYPES.get(x.device.type, ()):
            return None
        weights = [getattr(self, n) for n in self._flat_weights_names]
        states = [t for t in (h0, c0) if t is not None]
        if all(t.device == x.device and t.dtype == x.dtype for t in (*weights, *states)):
            _hop.note_opaque_op()  # (traced: a gradient around it is kept first-order)
            return weights
        return None

    def _run(self, x: Tensor, h0: Tensor | None, c0: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
        nd = 2 if self.bidirectional else 1
        batch = x.shape[1]
        real_hidden = self.proj_size if self.proj_size > 0 else self.hidden_size
        weights = self._use_fused(x, h0, c0)
        if h0 is None:
            h0 = x.new_zeros(self.num_layers * nd, batch, real_hidden)
        if self.mode == "LSTM" and c0 is None:
            c0 = x.new_zeros(self.num_layers * nd, batch, self.hidden_size)
        # under autocast, the dtype torch.nn computes this layer in where its fused kernel's
        # autocast rule casts (eagerly, torch's fused function casts for itself)
        ac = None if (weights is not None and not _context.is_tracing()) else _rnn_fused.autocast_dtype(
            self.mode, x, self.proj_size > 0
        )
        if ac is not None:
            h0 = h0.to(ac)
            c0 = c0.to(ac) if c0 is not None else None
            if weights is not None:  # traced: tfun's ops have no autocast rule
                x = x.to(ac)
                weights = [w.to(ac) if w.dtype == torch.float32 else w for w in weights]
                if not _rnn_fused.traced_pays(self.mode, x, self.proj_size > 0):
                    weights = None  # (a CPU without oneDNN's bfloat16 layer: the scan)
        if weights is not None:
            return _rnn_fused.fused(self.mode, x, h0, c0, weights, self.bias, self.num_layers, self.bidirectional,
                                    self.proj_size > 0)
        h_n, c_n = [], []
        k = 0
        for layer in range(self.num_layers):
            outs = []
            for direction in range(nd):
                names = self._all_weights[k]
                params = {n.rsplit("_l", 1)[0]: getattr(self, n) for n in names}
                ys, h, c = _scan_direction(
                    self.mode, x, h0[k], c0[k] if c0 is not None else None,
                    params["weight_ih"], params["weight_hh"], params.get("bias_ih"), params.get("bias_hh"),
                    params.get("weight_hr"), reverse=direction == 1,
                )
                outs.append(ys)
                h_n.append(h)
                if c is not None:
                    c_n.append(c)
                k += 1
            x = outs[0] if nd == 1 else torch.cat(outs, dim=2)
            if self.dropout > 0 and self.training and layer < self.num_layers - 1:
                x = F.dropout(x, p=self.dropout, training=True)
        return x, torch.stack(h_n), (torch.stack(c_n) if c_n else None)

    def init_state(self, batch_size: int | None = None, device: Any = None, dtype: Any = None) -> Any:
        """The zero state for `step` (what `forward` uses when `hx` is omitted).

        **Arguments:**

        - `batch_size`: the batch size, or `None` for unbatched inputs.
        - `device`, `dtype`: default to the parameters'.

        **Returns:** `h` of shape `(D * num_layers, batch_size, H_out)` (no batch axis when
        unbatched), where `H_out` is `proj_size` if set, else `hidden_size`; for `LSTM`, the
        pair `(h, c)` with `c` of shape `(D * num_layers, batch_size, hidden_size)`.
        """
        ref = next(self.parameters())
        factory = {"device": device or ref.device, "dtype": dtype or ref.dtype}
        layers = (2 if self.bidirectional else 1) * self.num_layers
        batch = () if batch_size is None else (batch_size,)
        h = torch.zeros(layers, *batch, self.proj_size or self.hidden_size, **factory)
        if self.mode == "LSTM":
            return h, torch.zeros(layers, *batch, self.hidden_size, **factory)
        return h

    def step(self, x_t: Tensor, state: Any) -> tuple[Tensor, Any]:
        """One time step, for inference: exactly what `forward` computes at that step.

        **Arguments:**

        - `x_t`: `(batch, input_size)`, or `(input_size,)` unbatched.
        - `state`: from `init_state` or the previous `step` (`hx` of `forward`).

        **Returns:** `(y_t, new_state)`: `y_t` is `(batch, H_out)` (`(H_out,)` unbatched)
        and `new_state` has the structure of `state`.
        """
        if self.bidirectional:
            raise ArgumentValueError(
                f"{self._layer_name}.step: a bidirectional layer has no step mode (its reverse direction "
                "reads the future); run `forward` over the whole sequence."
            )
        if not isinstance(x_t, Tensor) or x_t.dim() not in (1, 2):
            shape = tuple(x_t.shape) if isinstance(x_t, Tensor) else type(x_t).__name__
            raise ArgumentValueError(
                f"{self._layer_name}.step: x_t must be (batch, input_size) or (input_size,), but got {shape}."
            )
        time_axis = 1 if (self.batch_first and x_t.dim() == 2) else 0
        out, new_state = self(x_t.unsqueeze(time_axis), state)
        return out.squeeze(time_axis), new_state

    def _finish(self, out: Tensor, batched: bool) -> Tensor:
        if not batched:
            return out.squeeze(1)
        return out.transpose(0, 1) if self.batch_first else out


class RNN(_RNNBase):
    """Elman RNN, a drop-in replacement for `torch.nn.RNN`: `h_t = act(x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh)`.

    Every layer and direction is one `tfun.lax.scan`; the input projection is hoisted out
    of the loop. Parameters, initialization, inputs and outputs are torch's. Eager calls
    outside `torch.func` transforms run torch's fused kernels instead (see `fused`).

    **Arguments:**

    - `input_size`, `hidden_size`: feature sizes of `x` and `h`.
    - `num_layers`: stacked layers (default 1).
    - `nonlinearity`: `'tanh'` (default) or `'relu'`.
    - `bias`: whether to use `bias_ih_l*` / `bias_hh_l*`.
    - `batch_first`: input and output are `(batch, seq, feature)` instead of `(seq, batch, feature)`.
    - `dropout`: dropout probability on the outputs of every layer but the last (training only).
    - `bidirectional`: add a reverse-direction RNN per layer (`*_reverse` parameters).
    - `device`, `dtype`: factory arguments of the parameters.
    - `fused` (keyword-only, default `True`): eager calls run torch's fused kernels
      (`torch._VF.rnn_tanh` / `rnn_relu` / `lstm` / `gru`, as `torch.nn.RNN` does: oneDNN or
      ATen's C++ cells on the CPU, cuDNN on CUDA) with identical semantics, where all of
      these hold: not traced (`tfun.jit`, `torch.compile`, `torch.export` keep the scan,
      which lowers to torch's scan op; but the traced layers take fused ops on oneDNN's LSTM
      and on cuDNN: see `tfun.nn.LSTM`), no `torch.func` transform (`tfun.grad`,
      `tfun.vmap`, `tfun.jvp`, ...) and no `torch.autograd.forward_ad` dual level active, no
      dropout active (`dropout == 0` or `eval()`), parameters, input and state of one CPU
      or CUDA floating dtype. Otherwise the scan runs. `fused=False` always runs the scan.
      On the CPU double backward works on both paths (oneDNN's LSTM layer has a
      differentiable backward under `create_graph=True`; GRU, RNN, float64 and LSTMs with
      `proj_size` run ATen's composite cells); cuDNN's backward has no derivative (as for
      `torch.nn.LSTM` on CUDA: differentiate a gradient with `fused=False`, or with
      `tfun.grad` of `tfun.grad`, which takes the scan). On Ampere and later GPUs cuDNN runs
      float32 in TF32 unless `torch.backends.cudnn.allow_tf32` is off, as for
      `torch.nn.LSTM`.

    **Returns:** `forward(input, hx=None)` returns `(output, h_n)`: `output` is
    `(seq, batch, D * hidden_size)` (or batch-first, or `(seq, D * hidden_size)` for unbatched
    input) and `h_n` is `(D * num_layers, batch, hidden_size)`.
    """

    _layer_name = "tfun.nn.RNN"

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        nonlinearity: str = "tanh",
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        device: Any = None,
        dtype: Any = None,
        *,
        fused: bool = True,
    ) -> None:
        if nonlinearity == "tanh":
            mode = "RNN_TANH"
        elif nonlinearity == "relu":
            mode = "RNN_RELU"
        else:
            raise ArgumentValueError(f"tfun.nn.RNN: unknown nonlinearity {nonlinearity!r}; expected 'tanh' or 'relu'.")
        super().__init__(mode, input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         0, device, dtype, fused=fused)
        self.nonlinearity = nonlinearity

    def forward(self, input: Tensor, hx: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Run the RNN over `input`. See the class docstring for shapes.

        **Arguments:**

        - `input`: `(seq, batch, input_size)`, `(batch, seq, input_size)` if `batch_first`, or
          unbatched `(seq, input_size)`.
        - `hx`: initial hidden state `(D * num_layers, batch, hidden_size)` (unbatched: no batch
          axis); zeros if omitted.

        **Returns:** `(output, h_n)`.
        """
        x, batched, h0, _ = self._prepare(input, hx)
        out, h_n, _ = self._run(x, h0, None)
        return self._finish(out, batched), (h_n if batched else h_n.squeeze(1))


class LSTM(_RNNBase):
    """LSTM, a drop-in replacement for `torch.nn.LSTM` (Hochreiter & Schmidhuber 1997), with projections.

    Gates in torch's order i, f, g, o:
    `c_t = σ(f) c_{t-1} + σ(i) tanh(g)`, `h_t = σ(o) tanh(c_t)` (then `h_t W_hr^T` if
    `proj_size > 0`, Sak et al. 2014). Each layer and direction is one `tfun.lax.scan`;
    the input projection of all steps is one matmul before it. Eager calls outside
    `torch.func` transforms run torch's fused `torch._VF.lstm` instead (oneDNN on the CPU,
    cuDNN on CUDA; see `fused` in `tfun.nn.RNN`), several times faster.

    Under `tfun.jit` and `torch.compile` too, on the CPU in float32 and bfloat16 without
    projections (where torch runs oneDNN's fused LSTM layer), the layer calls oneDNN's layer
    kernels through opaque ops (`tfun::lstm_onednn` and its backward op where a gradient is
    wanted, `tfun::rnn_fused` for a forward alone), and on CUDA in float32, float16 and
    bfloat16 without projections cuDNN's (`tfun::rnn_cudnn` and its backward op), so a
    compiled training step runs the fused forward and backward kernels once each instead of
    a compiled scan (benchmarks/RESULTS.md). Inside a `torch.func` transform, a loop
    body, or a derivative that is differentiated again (`tfun.grad` of `tfun.grad`), and for
    `torch.export`, the traced layer runs the scan.

    **Arguments:**

    - `input_size`, `hidden_size`, `num_layers`, `bias`, `batch_first`, `dropout`,
      `bidirectional`, `device`, `dtype`, `fused`: as in `tfun.nn.RNN`.
    - `proj_size`: if > 0, project `h` to this size with `weight_hr_l*` (must be < hidden_size).

    **Returns:** `forward(input, hx=None)` returns `(output, (h_n, c_n))`; `h_n` is
    `(D * num_layers, batch, proj_size or hidden_size)`, `c_n` is `(D * num_layers, batch, hidden_size)`.
    """

    _layer_name = "tfun.nn.LSTM"

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        device: Any = None,
        dtype: Any = None,
        *,
        fused: bool = True,
    ) -> None:
        super().__init__("LSTM", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         proj_size, device, dtype, fused=fused)

    def forward(
        self, input: Tensor, hx: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Run the LSTM over `input`.

        **Arguments:**

        - `input`: `(seq, batch, input_size)`, batch-first, or unbatched `(seq, input_size)`.
        - `hx`: `(h_0, c_0)` or `None` (zeros).

        **Returns:** `(output, (h_n, c_n))`.
        """
        x, batched, h0, c0 = self._prepare(input, hx)
        out, h_n, c = self._run(x, h0, c0)
        c_n = cast(Tensor, c)  # an LSTM's run always returns the cell state
        if not batched:
            h_n, c_n = h_n.squeeze(1), c_n.squeeze(1)
        return self._finish(out, batched), (h_n, c_n)


class GRU(_RNNBase):
    """GRU, a drop-in replacement for `torch.nn.GRU` (Cho et al. 2014), with torch's exact formula.

    Gates in torch's order r, z, n: `r = σ(W_ir x + b_ir + W_hr h + b_hr)`,
    `z = σ(W_iz x + b_iz + W_hz h + b_hz)`, `n = tanh(W_in x + b_in + r * (W_hn h + b_hn))`,
    `h' = (1 - z) * n + z * h`.

    Eager calls outside `torch.func` transforms run torch's fused `torch._VF.gru` (see
    `fused` in `tfun.nn.RNN`).

    **Arguments:** as `tfun.nn.RNN` (without `nonlinearity`), `fused` included.

    **Returns:** `forward(input, hx=None)` returns `(output, h_n)` as `tfun.nn.RNN`.
    """

    _layer_name = "tfun.nn.GRU"

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        device: Any = None,
        dtype: Any = None,
        *,
        fused: bool = True,
    ) -> None:
        super().__init__("GRU", input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional,
                         0, device, dtype, fused=fused)

    def forward(self, input: Tensor, hx: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Run the GRU over `input`.

        **Arguments:**

        - `input`: `(seq, batch, input_size)`, batch-first, or unbatched `(seq, input_size)`.
        - `hx`: initial hidden state or `None` (zeros).

        **Returns:** `(output, h_n)`.
        """
        x, batched, h0, _ = self._prepare(input, hx)
        out, h_n, _ = self._run(x, h0, None)
        return self._finish(out, batched), (h_n if batched else h_n.squeeze(1))


# ----------------------------------------------------------------------------------------
# Cells
# ----------------------------------------------------------------------------------------


class _CellBase(nn.Module):
    _layer_name = "tfun.nn.RNNCellBase"

    def __init__(self, input_size: int, hidden_size: int, bias: bool, num_chunks: int, device: Any, dtype: Any) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        for arg, val in (("input_size", input_size), ("hidden_size", hidden_size)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ArgumentValueError(f"{self._layer_name}: {arg} must be a positive int, but got {val!r}.")
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.bias = bias
        self.weight_ih = nn.Parameter(torch.empty(num_chunks * hidden_size, input_size, **factory))
        self.weight_hh = nn.Parameter(torch.empty(num_chunks * hidden_size, hidden_size, **factory))
        if bias:
            self.bias_ih = nn.Parameter(torch.empty(num_chunks * hidden_size, **factory))
            self.bias_hh = nn.Parameter(torch.empty(num_chunks * hidden_size, **factory))
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw every parameter from U(-1/sqrt(hidden_size), 1/sqrt(hidden_size)), as torch does."""
        stdv = 1.0 / math.sqrt(self.hidden_size) if self.hidden_size > 0 else 0
        for weight in self.parameters():
            nn.init.uniform_(weight, -stdv, stdv)

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}"
        if self.bias is not True:
            s += f", bias={self.bias}"
        nl = getattr(self, "nonlinearity", "tanh")
        if nl != "tanh":
            s += f", nonlinearity={nl}"
        return s

    def _prepare(self, input: Any) -> tuple[Tensor, bool]:
        x = check_input(self._layer_name, input, ndims=(1, 2), features=self.input_size, dtype=self.weight_ih.dtype,
                        layout="(batch, input_size) or unbatched (input_size,)")
        batched = x.dim() == 2
        return (x if batched else x.unsqueeze(0)), batched

    def _state(self, arg: str, h: Any, batched: bool, batch: int, like: Tensor) -> Tensor:
        if h is None:
            return like.new_zeros(batch, self.hidden_size)
        shape = (batch, self.hidden_size) if batched else (self.hidden_size,)
        h = check_state(self._layer_name, arg, h, shape, self.weight_ih.dtype)
        return h if batched else h.unsqueeze(0)


class RNNCell(_CellBase):
    """One step of an Elman RNN, a drop-in replacement for `torch.nn.RNNCell`.

    `h' = act(x W_ih^T + b_ih + h W_hh^T + b_hh)`.

    **Arguments:**

    - `input_size`, `hidden_size`: feature sizes.
    - `bias`: whether to use `bias_ih` and `bias_hh`.
    - `nonlinearity`: `'tanh'` (default) or `'relu'`.
    - `device`, `dtype`: factory arguments.

    **Returns:** `forward(input, hx=None)` returns `h'`, `(batch, hidden_size)` (or `(hidden_size,)`).
    """

    _layer_name = "tfun.nn.RNNCell"

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, nonlinearity: str = "tanh",
                 device: Any = None, dtype: Any = None) -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ArgumentValueError(
                f"tfun.nn.RNNCell: unknown nonlinearity {nonlinearity!r}; expected 'tanh' or 'relu'."
            )
        super().__init__(input_size, hidden_size, bias, 1, device, dtype)
        self.nonlinearity = nonlinearity

    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:
        """One step.

        **Arguments:**

        - `input`: `(batch, input_size)` or `(input_size,)`.
        - `hx`: `(batch, hidden_size)` (or `(hidden_size,)`), zeros if omitted.

        **Returns:** the new hidden state, shaped like `hx`.
        """
        x, batched = self._prepare(input)
        h = self._state("hx", hx, batched, x.shape[0], x)
        pre = F.linear(x, self.weight_ih, self.bias_ih) + F.linear(h, self.weight_hh, self.bias_hh)
        out = torch.tanh(pre) if self.nonlinearity == "tanh" else torch.relu(pre)
        return out if batched else out.squeeze(0)


class LSTMCell(_CellBase):
    """One LSTM step, a drop-in replacement for `torch.nn.LSTMCell` (gates i, f, g, o).

    **Arguments:**

    - `input_size`, `hidden_size`, `bias`, `device`, `dtype`: as `tfun.nn.RNNCell`.

    **Returns:** `forward(input, hx=None)` returns `(h', c')`.
    """

    _layer_name = "tfun.nn.LSTMCell"

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, device: Any = None, dtype: Any = None) -> None:
        super().__init__(input_size, hidden_size, bias, 4, device, dtype)

    def forward(self, input: Tensor, hx: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """One step.

        **Arguments:**

        - `input`: `(batch, input_size)` or `(input_size,)`.
        - `hx`: `(h, c)`, each `(batch, hidden_size)` (or unbatched), zeros if omitted.

        **Returns:** `(h', c')`.
        """
        x, batched = self._prepare(input)
        if hx is None:
            h = c = None
        else:
            if not isinstance(hx, (tuple, list)) or len(hx) != 2:
                raise ArgumentValueError(f"{self._layer_name}: hx must be a tuple (h, c), but got {type(hx).__name__}.")
            h, c = hx
        h = self._state("h", h, batched, x.shape[0], x)
        c = self._state("c", c, batched, x.shape[0], x)
        g = F.linear(x, self.weight_ih, self.bias_ih) + F.linear(h, self.weight_hh, self.bias_hh)
        i, f, gg, o = g.chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(gg)
        h = torch.sigmoid(o) * torch.tanh(c)
        return (h, c) if batched else (h.squeeze(0), c.squeeze(0))


class GRUCell(_CellBase):
    """One GRU step, a drop-in replacement for `torch.nn.GRUCell` (gates r, z, n; torch's formula).

    **Arguments:**

    - `input_size`, `hidden_size`, `bias`, `device`, `dtype`: as `tfun.nn.RNNCell`.

    **Returns:** `forward(input, hx=None)` returns `h'`.
    """

    _layer_name = "tfun.nn.GRUCell"

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, device: Any = None, dtype: Any = None) -> None:
        super().__init__(input_size, hidden_size, bias, 3, device, dtype)

    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:
        """One step.

        **Arguments:**

        - `input`: `(batch, input_size)` or `(input_size,)`.
        - `hx`: `(batch, hidden_size)` (or unbatched), zeros if omitted.

        **Returns:** the new hidden state.
        """
        x, batched = self._prepare(input)
        h = self._state("hx", hx, batched, x.shape[0], x)
        x_r, x_z, x_n = F.linear(x, self.weight_ih, self.bias_ih).chunk(3, 1)
        h_r, h_z, h_n = F.linear(h, self.weight_hh, self.bias_hh).chunk(3, 1)
        r = torch.sigmoid(x_r + h_r)
        z = torch.sigmoid(x_z + h_z)
        n = torch.tanh(x_n + r * h_n)
        out = (1 - z) * n + z * h
        return out if batched else out.squeeze(0)
