"""Diagonal linear-recurrent layers: `S4D`, `S5`, `LRU`, `MinGRU`.

Each runs its recurrence in parallel over time and has a `step` mode for inference that
computes the same function one position at a time. MinGRU's real recurrence is
`tfun.lax.linear_scan` (`linear_recurrence`); the complex diagonal ones of S4D (scan mode), S5
and LRU are `_diagonal_scan.diagonal_scan`, on real/imaginary pairs, with real projections
around it.
"""


import math
from typing import Any

import torch
from jaxtyping import Complex, Float
from torch import Tensor, nn

from .. import _compat
from .._errors import ArgumentValueError
from ._common import check_input, check_state, linear_recurrence
from ..lax import _hop
from ._diagonal_scan import diagonal_scan


def _complex_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.complex128 if dtype == torch.float64 else torch.complex64


def _f32(t: Tensor) -> Tensor:
    """A half-precision parameter in float32 (others as they are): the discretizations below
    form `exp(log Δ)`, `exp(log A)` in float32 and round only their results. Rounded in half
    precision before `_zoh`, Inductor kept the rounding in some of the backward's consumers
    and dropped it in others, and the gradient in `A`, which cancels terms of size `Δ` to size
    `Δ²`, came out wrong (S4D bfloat16: a relative 0.75 at `Δ = e^-7`)."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def _like(parts: tuple[Tensor, ...], dtype: torch.dtype) -> tuple[Tensor, ...]:
    return tuple(p.to(dtype) for p in parts)


def _zoh(a_re: Tensor, a_im: Tensor, dt: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Zero-order hold of the complex diagonal `A` with step `dt`, in real arithmetic:
    `z = ΔA` (so `Ā = exp(z)`) and `f = (exp(ΔA) - 1) / A` (so `B̄ = f B`), as real and
    imaginary parts. `exp(ΔA) - 1` is formed with `_compat.expm1`, accurate for small steps
    (under `tfun.jit` too). Half-precision parameters are discretized in float32 and the parts
    returned in their dtype (`f`'s gradient in `A` cancels terms of size `Δ` to size `Δ²`)."""
    if a_re.dtype in (torch.bfloat16, torch.float16):
        parts = _zoh(a_re.float(), a_im.float(), dt.float())
        return tuple(p.to(a_re.dtype) for p in parts)  # type: ignore[return-value]
    zr, zi = a_re * dt, a_im * dt
    e_re = _compat.expm1(zr) * torch.cos(zi) - 2 * torch.sin(0.5 * zi) ** 2  # Re exp(z) - 1
    e_im = torch.exp(zr) * torch.sin(zi)
    den = a_re * a_re + a_im * a_im
    return zr, zi, (e_re * a_re + e_im * a_im) / den, (e_im * a_re - e_re * a_im) / den


class _SSMBase(nn.Module):
    _layer_name = "tfun.nn.SSM"
    d_model: int

    def _param_dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def _check_x(self, x: Any) -> Tensor:
        return check_input(self._layer_name, x, ndims=(3,), features=self.d_model, dtype=self._param_dtype(),
                           layout="(batch, length, d_model)")

    def _check_xt(self, x: Any) -> Tensor:
        return check_input(f"{self._layer_name}.step", x, ndims=(2,), features=self.d_model,
                           dtype=self._param_dtype(), layout="(batch, d_model)")

    def _check_state(self, state: Any, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return check_state(f"{self._layer_name}.step", "state", state, shape, dtype)


class _ComplexDiagonalSSM(_SSMBase):
    """LRU and S5: a complex diagonal state `(batch, d_state)` read out as
    `readout_scale * Re(h C^T) + D * x`."""

    _readout_scale = 1.0

    def _discrete_parts(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """`(zr, zi, B_re, B_im, C_re, C_im)`: `λ = exp(zr + i zi)` `(d_state,)`, the input
        matrix `(d_state, d_model)` and the readout `(d_model, d_state)`, in real parts."""
        raise NotImplementedError

    def _discrete(self) -> tuple[Tensor, Tensor, Tensor]:
        """`(λ, B, C)` as complex tensors (the step mode's form of `_discrete_parts`)."""
        zr, zi, b_re, b_im, c_re, c_im = (_f32(p) for p in self._discrete_parts())  # (half: in complex64)
        return torch.exp(torch.complex(zr, zi)), torch.complex(b_re, b_im), torch.complex(c_re, c_im)

    def forward(self, x: Float[Tensor, "batch length d_model"]) -> Float[Tensor, "batch length d_model"]:
        """Parallel mode.

        **Arguments:**

        - `x`: `(batch, length, d_model)`.

        **Returns:** `(batch, length, d_model)`.
        """
        x = self._check_x(x)
        zr, zi, b_re, b_im, c_re, c_im = self._discrete_parts()
        n = zr.shape[0]
        # B u in real and imaginary parts: one real product (x is real)
        bu = x.to(b_re.dtype) @ torch.cat([b_re, b_im], dim=0).t()  # (b, l, 2n)
        hr, hi = diagonal_scan(zr, zi, bu[..., :n], bu[..., n:])
        # Re(h Cᵀ) = h_re C_reᵀ - h_im C_imᵀ: one real product
        y = torch.cat([hr, hi], dim=-1) @ torch.cat([c_re, -c_im], dim=1).t()
        return self._readout_scale * y + self.D * x

    def init_state(self, batch_size: int, device: Any = None, dtype: Any = None) -> Complex[Tensor, "batch d_state"]:
        """Zero state `(batch, d_state)`, complex.

        **Arguments:**

        - `batch_size`: batch size; `device`, `dtype` (real) default to the parameters'.

        **Returns:** the zero state.
        """
        dtype = _complex_dtype(dtype or self._param_dtype())
        return torch.zeros(batch_size, self.d_state, dtype=dtype, device=device or self.D.device)

    def step(self, x_t: Float[Tensor, "batch d_model"], state: Complex[Tensor, "batch d_state"]
             ) -> tuple[Float[Tensor, "batch d_model"], Complex[Tensor, "batch d_state"]]:
        """One position of the recurrence.

        **Arguments:**

        - `x_t`: `(batch, d_model)`.
        - `state`: `(batch, d_state)` complex.

        **Returns:** `(y_t, new_state)`.
        """
        x_t = self._check_xt(x_t)
        lam, B, C = self._discrete()
        h = self._check_state(state, (x_t.shape[0], self.d_state), lam.dtype)
        h = lam * h + x_t.to(B.dtype) @ B.t()
        return (self._readout_scale * (h @ C.t()).real).to(x_t.dtype) + self.D * x_t, h


class LRU(_ComplexDiagonalSSM):
    """Linear Recurrent Unit of Orvieto et al., "Resurrecting Recurrent Neural Networks for Long Sequences" (ICML 2023).

    `h_t = λ ⊙ h_{t-1} + γ ⊙ (B u_t)`, `y_t = Re(C h_t) + D ⊙ u_t`, with a complex diagonal
    `λ = exp(-exp(ν_log) + i exp(θ_log))` (exponential parameterization), the normalization
    `γ = exp(γ_log)` initialized to `sqrt(1 - |λ|²)`, and the ring initialization: `|λ|`
    uniform on the ring `[r_min, r_max]` of the complex disk (`ν_log = log(-½ log(u₁(r_max² -
    r_min²) + r_min²))`) and phase uniform in `[0, max_phase]`. `B`, `C` are complex
    Glorot-style normals (`B ~ N(0, 1/(2 d_model))`, `C ~ N(0, 1/d_state)` per part), `D ~ N(0, 1)`.

    **Arguments:**

    - `d_model`: input and output width H.
    - `d_state`: number of complex state units N.
    - `r_min`, `r_max`: ring of the eigenvalue magnitudes (default 0, 1).
    - `max_phase`: largest eigenvalue phase (default 2π).
    - `device`, `dtype`: factory arguments (real dtype; the state is its complex counterpart).

    **Returns:** `forward(x)` maps `(batch, length, d_model)` to the same shape.
    """

    _layer_name = "tfun.nn.LRU"

    def __init__(self, d_model: int, d_state: int, r_min: float = 0.0, r_max: float = 1.0,
                 max_phase: float = 2 * math.pi, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        if not 0 <= r_min < r_max <= 1:
            raise ArgumentValueError(f"{self._layer_name}: need 0 <= r_min < r_max <= 1, got r_min={r_min}, r_max={r_max}.")
        f = {"device": device, "dtype": dtype}
        self.d_model, self.d_state = d_model, d_state
        u1 = torch.rand(d_state, **f)
        u2 = torch.rand(d_state, **f)
        nu_log = torch.log(-0.5 * torch.log(u1 * (r_max**2 - r_min**2) + r_min**2))
        theta_log = torch.log(max_phase * u2)
        self.nu_log = nn.Parameter(nu_log)
        self.theta_log = nn.Parameter(theta_log)
        lam_abs = torch.exp(-torch.exp(nu_log))
        self.gamma_log = nn.Parameter(torch.log(torch.sqrt(1 - lam_abs**2)))
        self.B_re = nn.Parameter(torch.randn(d_state, d_model, **f) / math.sqrt(2 * d_model))
        self.B_im = nn.Parameter(torch.randn(d_state, d_model, **f) / math.sqrt(2 * d_model))
        self.C_re = nn.Parameter(torch.randn(d_model, d_state, **f) / math.sqrt(d_state))
        self.C_im = nn.Parameter(torch.randn(d_model, d_state, **f) / math.sqrt(d_state))
        self.D = nn.Parameter(torch.randn(d_model, **f))

    def _discrete_parts(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        gamma = torch.exp(_f32(self.gamma_log)).unsqueeze(-1)
        # `log λ = -ν + iθ` stays in float32 for half-precision parameters (the scan runs in
        # float32): the phase θ is up to 2π, and rounded to bfloat16 it carried an error of up
        # to 0.02 rad per step that the recurrence multiplied by t (hunt 26, F0: the output off
        # by 4.6%, the `theta_log` gradient by 47%, against float64 with the same parameters)
        log_lam = (-torch.exp(_f32(self.nu_log)), torch.exp(_f32(self.theta_log)))
        b = _like((_f32(self.B_re) * gamma, _f32(self.B_im) * gamma), self.nu_log.dtype)
        return (*log_lam, *b, self.C_re, self.C_im)  # type: ignore[return-value]


class S4D(_SSMBase):
    """S4D: the diagonal S4 of Gu, Gupta, Goel & Ré, "On the Parameterization and Initialization of Diagonal State Space Models" (NeurIPS 2022).

    Per channel `h` of `d_model` channels, a diagonal complex SSM with `d_state // 2` modes
    (the other half are their complex conjugates, hence the `2 Re`):
    `x_t = Ā x_{t-1} + B̄ u_t`, `y_t = 2 Re(C x_t) + D u_t`, discretized with zero-order hold,
    `Ā = exp(ΔA)`, `B̄ = (exp(ΔA) - 1) / A · B` (`B = 1`, folded into `C` as in the paper).
    S4D-Lin initialization: `A_n = -½ + iπn`, stored as `log_A_real = log ½` and `A_imag = πn`;
    `Δ = exp(log_dt)` log-uniform in `[dt_min, dt_max]`; `C ~ CN(0, 1)` (stored as its real
    view `(d_model, d_state // 2, 2)`); `D ~ N(0, 1)`.

    Two ways to run a whole sequence, with the same outputs and gradients (to rounding):

    - `mode="conv"` (the default, for training): the paper's convolution mode. The
      kernel `K_l = 2 Re(Σ_n C_n B̄_n Ā_n^l)` (the Vandermonde product, `l < L`) is computed
      in real arithmetic as blocked matrix products (`S4D.kernel`), and `y = K * u + D u` is
      a causal convolution by FFT (`rfft` of length 2L, product, `irfft`), `O(L log L)` per
      channel. The kernel keeps `O(d_model · (L + d_state · (64 + L / 64)))` numbers for the
      backward, not `O(d_model · d_state · L)`.
    - `mode="scan"`: the recurrence, scanned in parallel over time.

    `step` runs the recurrence one position at a time (inference); it agrees with both.

    **Arguments:**

    - `d_model`: channels H.
    - `d_state`: state size N (N // 2 complex modes; default 64).
    - `dt_min`, `dt_max`: range of the step size initialization.
    - `mode`: `"conv"` or `"scan"`, how `forward` runs (an attribute: it may be changed later).
    - `device`, `dtype`: factory arguments.

    **Returns:** `forward(x)` maps `(batch, length, d_model)` to the same shape.
    """

    _layer_name = "tfun.nn.S4D"

    def __init__(self, d_model: int, d_state: int = 64, dt_min: float = 0.001, dt_max: float = 0.1,
                 mode: str = "conv", device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        if d_state < 2 or d_state % 2:
            raise ArgumentValueError(f"{self._layer_name}: d_state must be an even number >= 2, got {d_state}.")
        f = {"device": device, "dtype": dtype}
        self.d_model, self.d_state = d_model, d_state
        self.mode = mode
        self._check_mode()
        n = d_state // 2
        self.log_dt = nn.Parameter(torch.rand(d_model, **f) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dtype_c = _complex_dtype(self.log_dt.dtype)
        self.C = nn.Parameter(torch.view_as_real(torch.randn(d_model, n, dtype=dtype_c, device=device)).contiguous())
        self.log_A_real = nn.Parameter(torch.log(0.5 * torch.ones(d_model, n, **f)))
        self.A_imag = nn.Parameter(math.pi * torch.arange(n, **f).repeat(d_model, 1))
        self.D = nn.Parameter(torch.randn(d_model, **f))

    def _discrete_parts(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """`(zr, zi, f_re, f_im)`, each `(d_model, d_state // 2)`: `Ā = exp(z)`, `B̄ = f`."""
        parts = _zoh(-torch.exp(_f32(self.log_A_real)), _f32(self.A_imag), torch.exp(_f32(self.log_dt)).unsqueeze(-1))
        return _like(parts, self.log_A_real.dtype)  # type: ignore[return-value]

    def _discrete(self) -> tuple[Tensor, Tensor, Tensor]:
        zr, zi, f_re, f_im = (_f32(p) for p in self._discrete_parts())  # (half: in complex64)
        return torch.exp(torch.complex(zr, zi)), torch.complex(f_re, f_im), torch.view_as_complex(_f32(self.C))

    def forward(self, x: Float[Tensor, "batch length d_model"]) -> Float[Tensor, "batch length d_model"]:
        """Parallel mode.

        **Arguments:**

        - `x`: `(batch, length, d_model)`.

        **Returns:** `(batch, length, d_model)`.
        """
        x = self._check_x(x)
        # exported with a length that may be a `Dim`: the recurrence (the convolution kernel's
        # block count would specialize the length, and export refuse the `Dim`; hunt 28)
        if self._check_mode() == "conv" and not _hop.exported_length_may_be_symbolic(x.shape[1]):
            return _causal_conv(x, self.kernel(x.shape[1])) + self.D * x
        zr, zi, f_re, f_im = self._discrete_parts()
        b, length, h, n = *x.shape, zr.shape[-1]
        xc = x.to(zr.dtype).unsqueeze(-1)  # B̄ u, (b, l, h, n), scanned as h * n channels
        hr, hi = diagonal_scan(zr.reshape(-1), zi.reshape(-1), (f_re * xc).reshape(b, length, h * n),
                               (f_im * xc).reshape(b, length, h * n))
        c_re, c_im = self.C[..., 0], self.C[..., 1]
        y = (hr.reshape(b, length, h, n) * c_re - hi.reshape(b, length, h, n) * c_im).sum(-1)  # Re(C h)
        return 2 * y + self.D * x

    def _check_mode(self) -> str:
        if self.mode not in ("conv", "scan"):
            raise ArgumentValueError(
                f'{self._layer_name}: mode must be "conv" (the FFT convolution, for training) or "scan" '
                f"(the recurrence), but it is {self.mode!r}."
            )
        return self.mode

    def kernel(self, length: int) -> Float[Tensor, "d_model length"]:
        """The convolution kernel `K_l = 2 Re(Σ_n C_n B̄_n Ā_n^l)` for `l < length`, shape
        `(d_model, length)`, computed in real arithmetic (differentiable; no complex ops, so
        Inductor compiles it).

        The Vandermonde product is computed in blocks: with `l = qM + r` (`M = 64`),
        `Ā^l = Ā^{qM} Ā^r`, so `K_{qM+r} = 2 Re Σ_n (W_n Ā_n^r)(Ā_n^{qM})` (`W = C B̄`) is one
        real matrix product per channel of a `(⌈length/M⌉, N)` by an `(N, M)` table. The
        powers are `exp(lΔA)` evaluated directly (no repeated products), and only
        `O(d_model · d_state · (M + length/M))` exponentials and sines are computed or kept
        for the backward, instead of `O(d_model · d_state · length)`.

        **Arguments:**

        - `length`: how many positions.

        **Returns:** the real kernel (without the skip term `D`).
        """
        # ΔA and B̄ = (exp(ΔA) - 1) / A, and the weight W = C B̄, in real and imaginary parts
        da_re, da_im, b_re, b_im = self._discrete_parts()  # (h, n) each
        c_re, c_im = self.C[..., 0], self.C[..., 1]
        w_re, w_im = c_re * b_re - c_im * b_im, c_re * b_im + c_im * b_re
        # M is a constant, not ⌈√length⌉: under tfun.jit's dynamic shapes `length` is symbolic
        block = _KERNEL_BLOCK
        blocks = -(-length // block)
        da_re, da_im = da_re.unsqueeze(-1), da_im.unsqueeze(-1)  # ΔA, (h, n, 1)
        r = torch.arange(block, dtype=da_re.dtype, device=da_re.device)
        q = torch.arange(blocks, dtype=da_re.dtype, device=da_re.device) * block
        # W Ā^r, (h, n, M)
        mag_r, ang_r = torch.exp(da_re * r), da_im * r
        cos_r, sin_r = torch.cos(ang_r), torch.sin(ang_r)
        p_re = mag_r * (w_re.unsqueeze(-1) * cos_r - w_im.unsqueeze(-1) * sin_r)
        p_im = mag_r * (w_re.unsqueeze(-1) * sin_r + w_im.unsqueeze(-1) * cos_r)
        # Ā^{qM}, (h, n, Q)
        mag_q, ang_q = torch.exp(da_re * q), da_im * q
        # Re(P Q) = P_re Q_re - P_im Q_im: (h, Q, 2n) @ (h, 2n, M) -> (h, Q, M), l = qM + r
        qs = torch.cat([mag_q * torch.cos(ang_q), -mag_q * torch.sin(ang_q)], dim=1).transpose(1, 2)
        ps = torch.cat([p_re, p_im], dim=1)
        return 2 * torch.bmm(qs, ps).reshape(self.d_model, blocks * block)[:, :length]

    def init_state(self, batch_size: int, device: Any = None, dtype: Any = None) -> Complex[Tensor, "batch d_model modes"]:
        """Zero state `(batch, d_model, d_state // 2)`, complex.

        **Arguments:**

        - `batch_size`: batch size; `device`, `dtype` (real) default to the parameters'.

        **Returns:** the zero state.
        """
        dtype = _complex_dtype(dtype or self._param_dtype())
        return torch.zeros(batch_size, self.d_model, self.d_state // 2, dtype=dtype, device=device or self.D.device)

    def step(self, x_t: Float[Tensor, "batch d_model"], state: Complex[Tensor, "batch d_model modes"]
             ) -> tuple[Float[Tensor, "batch d_model"], Complex[Tensor, "batch d_model modes"]]:
        """One position of the recurrence.

        **Arguments:**

        - `x_t`: `(batch, d_model)`.
        - `state`: `(batch, d_model, d_state // 2)` complex.

        **Returns:** `(y_t, new_state)`.
        """
        x_t = self._check_xt(x_t)
        A_bar, B_bar, C = self._discrete()
        h = self._check_state(state, (x_t.shape[0], self.d_model, self.d_state // 2), A_bar.dtype)
        h = A_bar * h + B_bar * x_t.unsqueeze(-1).to(B_bar.dtype)
        return (2 * (h * C).sum(-1).real).to(x_t.dtype) + self.D * x_t, h


#: Block size M of `S4D.kernel`'s Vandermonde product (`l = qM + r`).
_KERNEL_BLOCK = 64


def _causal_conv(x: Tensor, k: Tensor) -> Tensor:
    """`y[b, t, h] = Σ_{s<=t} k[h, t-s] x[b, s, h]`, by FFT (zero-padded to 2L, so nothing
    wraps around). float16/bfloat16 are transformed in float32."""
    L = x.shape[1]
    if L == 0:  # nothing to transform (an FFT of 0 points is an error)
        return x * k.sum(-1).to(x.dtype)
    work = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    n = 2 * L
    xf = torch.fft.rfft(x.transpose(1, 2).to(work), n=n)  # (b, h, n/2+1)
    kf = torch.fft.rfft(k.to(work), n=n)  # (h, n/2+1)
    y = torch.fft.irfft(xf * kf, n=n)[..., :L]
    return y.transpose(1, 2).to(x.dtype)


def _hippo_n(n: int) -> tuple[Tensor, Tensor]:
    """Eigen-decomposition of HiPPO-N, the normal part of HiPPO-LegS (S5 paper, §4.1): (Λ, V)."""
    idx = torch.arange(n, dtype=torch.float64)
    p = torch.sqrt(2 * idx + 1)
    A = -torch.tril(p[:, None] * p[None, :], -1) - torch.diag(idx + 1)
    P = torch.sqrt(idx + 0.5)
    S = A + P[:, None] * P[None, :]  # normal: -1/2 I + skew-symmetric
    lam_re = torch.diagonal(S).mean()
    lam_im, V = torch.linalg.eigh(S.to(torch.complex128) * -1j)
    return torch.complex(torch.full_like(lam_im, lam_re.item()), lam_im), V


class S5(_ComplexDiagonalSSM):
    """S5 layer of Smith, Warrington & Linderman, "Simplified State Space Layers for Sequence Modeling" (ICLR 2023).

    One multi-input multi-output SSM with a complex diagonal state of `d_state` modes and
    their conjugates (conjugate symmetry): `x_t = Λ̄ x_{t-1} + B̄ u_t`,
    `y_t = 2 Re(C̃ x_t) + D u_t`. Zero-order hold with one learned step per mode:
    `Λ̄ = exp(ΛΔ)`, `B̄ = Λ⁻¹(Λ̄ - 1) B̃`. Initialization (the paper's): `Λ` are the
    eigenvalues with positive imaginary part of HiPPO-N of size `2 d_state` (real part
    -½), `B̃ = V⁻¹B`, `C̃ = CV` with `V` its eigenvectors, `B` LeCun-normal, `C` complex
    normal, `D ~ N(0, 1)`, `Δ = exp(log_step)` log-uniform in `[dt_min, dt_max]`. The
    recurrence runs in parallel over time (the paper's associative scan; a chunked form when
    traced), in real arithmetic around it.

    **Arguments:**

    - `d_model`: input/output width H.
    - `d_state`: number of complex modes P (the real state size is 2P).
    - `dt_min`, `dt_max`: range of the step initialization.
    - `device`, `dtype`: factory arguments.

    **Returns:** `forward(x)` maps `(batch, length, d_model)` to the same shape.
    """

    _readout_scale = 2.0  # conjugate-symmetric eigenvalues: y = 2 Re(C h)
    _layer_name = "tfun.nn.S5"

    def __init__(self, d_model: int, d_state: int, dt_min: float = 0.001, dt_max: float = 0.1,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        f = {"device": device, "dtype": dtype}
        self.d_model, self.d_state = d_model, d_state
        lam, V = _hippo_n(2 * d_state)
        keep = torch.argsort(lam.imag, descending=True)[:d_state]
        lam, V = lam[keep], V[:, keep]  # (P,), (2P, P)
        B = torch.randn(2 * d_state, d_model, dtype=torch.float64) / math.sqrt(d_model)
        C = torch.complex(torch.randn(d_model, 2 * d_state, dtype=torch.float64),
                          torch.randn(d_model, 2 * d_state, dtype=torch.float64)) / math.sqrt(2 * d_state)
        B_t = V.conj().t() @ B.to(torch.complex128)
        C_t = C @ V
        pd = dtype or torch.get_default_dtype()
        self.Lambda_re = nn.Parameter(lam.real.to(device=device, dtype=pd))
        self.Lambda_im = nn.Parameter(lam.imag.to(device=device, dtype=pd))
        self.B = nn.Parameter(torch.view_as_real(B_t).to(device=device, dtype=pd).contiguous())
        self.C = nn.Parameter(torch.view_as_real(C_t).to(device=device, dtype=pd).contiguous())
        self.D = nn.Parameter(torch.randn(d_model, **f))
        self.log_step = nn.Parameter(torch.rand(d_state, **f) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))

    def _discrete_parts(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        zr, zi, f_re, f_im = _zoh(_f32(self.Lambda_re), _f32(self.Lambda_im), torch.exp(_f32(self.log_step)))
        f_re, f_im = f_re.unsqueeze(-1), f_im.unsqueeze(-1)
        b_re, b_im = _f32(self.B[..., 0]), _f32(self.B[..., 1])
        parts = _like((zr, zi, f_re * b_re - f_im * b_im, f_re * b_im + f_im * b_re), self.Lambda_re.dtype)
        return (*parts, self.C[..., 0], self.C[..., 1])  # type: ignore[return-value]


class MinGRU(_SSMBase):
    """minGRU of Feng, Tung, Ahmed, Bengio & Hajimirsadeghi, "Were RNNs All We Needed?" (2024).

    `z_t = σ(Linear_z(x_t))`, `h̃_t = Linear_h(x_t)`, `h_t = (1 - z_t) ⊙ h_{t-1} + z_t ⊙ h̃_t`.
    The gates depend on the input only, so the recurrence is linear in `h` and runs in
    parallel with `linear_recurrence` (a = 1 - z, b = z ⊙ h̃), in the paper's linear-space form.
    Parameters: `linear_z` and `linear_h` (`nn.Linear(d_model, d_hidden)`, default init).

    **Arguments:**

    - `d_model`: input width.
    - `d_hidden`: hidden (and output) width; defaults to `d_model`.
    - `bias`: bias in the two linear maps.
    - `device`, `dtype`: factory arguments.

    **Returns:** `forward(x, h0=None)` maps `(batch, length, d_model)` to `(batch, length, d_hidden)`.
    """

    _layer_name = "tfun.nn.MinGRU"

    def __init__(self, d_model: int, d_hidden: int | None = None, bias: bool = True,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        f = {"device": device, "dtype": dtype}
        self.d_model = d_model
        self.d_hidden = d_hidden or d_model
        self.linear_z = nn.Linear(d_model, self.d_hidden, bias=bias, **f)
        self.linear_h = nn.Linear(d_model, self.d_hidden, bias=bias, **f)

    def forward(self, x: Float[Tensor, "batch length d_model"],
                h0: Float[Tensor, "batch d_hidden"] | None = None) -> Float[Tensor, "batch length d_hidden"]:
        """Parallel mode.

        **Arguments:**

        - `x`: `(batch, length, d_model)`.
        - `h0`: initial state `(batch, d_hidden)`, zeros if omitted.

        **Returns:** all states `(batch, length, d_hidden)`.
        """
        x = self._check_x(x)
        if h0 is not None:
            h0 = check_state(self._layer_name, "h0", h0, (x.shape[0], self.d_hidden), self._param_dtype())
        z = torch.sigmoid(self.linear_z(x))
        h_tilde = self.linear_h(x)
        return linear_recurrence(1 - z, z * h_tilde, axis=1, init=h0)

    def init_state(self, batch_size: int, device: Any = None, dtype: Any = None) -> Float[Tensor, "batch d_hidden"]:
        """Zero state `(batch, d_hidden)`.

        **Arguments:**

        - `batch_size`: batch size; `device`, `dtype` default to the parameters'.

        **Returns:** the zero state.
        """
        return torch.zeros(batch_size, self.d_hidden, dtype=dtype or self._param_dtype(),
                           device=device or self.linear_z.weight.device)

    def step(self, x_t: Float[Tensor, "batch d_model"], state: Float[Tensor, "batch d_hidden"]
             ) -> tuple[Float[Tensor, "batch d_hidden"], Float[Tensor, "batch d_hidden"]]:
        """One position: `h = (1 - z) h + z h̃`.

        **Arguments:**

        - `x_t`: `(batch, d_model)`.
        - `state`: `(batch, d_hidden)`.

        **Returns:** `(h_t, h_t)`.
        """
        x_t = self._check_xt(x_t)
        h = self._check_state(state, (x_t.shape[0], self.d_hidden), self._param_dtype())
        z = torch.sigmoid(self.linear_z(x_t))
        h = (1 - z) * h + z * self.linear_h(x_t)
        return h, h
