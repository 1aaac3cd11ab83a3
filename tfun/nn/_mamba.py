"""The Mamba block (Gu & Dao 2023) on `tfun.nn.selective_scan`."""


import math
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from .._errors import ArgumentValueError
from ._common import check_input, check_state
from ._selective_scan import selective_scan

MambaState = tuple[Float[Tensor, "batch d_inner d_conv"], Float[Tensor, "batch d_inner d_state"]]


class Mamba(nn.Module):
    """The Mamba block of Gu & Dao, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces" (2023).

    `in_proj` splits the input into a branch `x` and a gate `z`; `x` goes through a
    causal depthwise `conv1d` and SiLU, then the selective SSM (S6) whose `Δ`, `B`, `C`
    are projected from `x` by `x_proj` / `dt_proj`, with `A = -exp(A_log)` and skip `D`;
    the result is gated by `silu(z)` and projected back by `out_proj`. Submodule and
    parameter names, shapes and initialization follow the reference implementation
    (S4D-Real `A_log = log(1..d_state)`, `dt_proj.bias` = softplus⁻¹ of `dt` log-uniform in
    `[dt_min, dt_max]` floored at `dt_init_floor`, `D = 1`), so its checkpoints load.

    **Arguments:**

    - `d_model`: model width.
    - `d_state`: SSM state size N (default 16).
    - `d_conv`: causal convolution width (default 4).
    - `expand`: `d_inner = expand * d_model` (default 2).
    - `dt_rank`: rank of the Δ projection, or `"auto"` = `ceil(d_model / 16)`.
    - `dt_min`, `dt_max`, `dt_init`, `dt_scale`, `dt_init_floor`: Δ initialization.
    - `conv_bias`: bias in `conv1d`; `bias`: bias in `in_proj` / `out_proj`.
    - `use_fast_path`, `layer_idx`: accepted for compatibility; unused.
    - `device`, `dtype`: factory arguments.

    **Returns:** `forward(x)` maps `(batch, length, d_model)` to the same shape; `step`
    advances one token with a state `(conv_state, ssm_state)` from `init_state`.
    """

    def __init__(
        self,
        d_model: int,
        d_state: int = 16,
        d_conv: int = 4,
        expand: int = 2,
        dt_rank: int | str = "auto",
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init: str = "random",
        dt_scale: float = 1.0,
        dt_init_floor: float = 1e-4,
        conv_bias: bool = True,
        bias: bool = False,
        use_fast_path: bool = True,
        layer_idx: int | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.d_model = d_model
        self.d_state = d_state
        self.d_conv = d_conv
        self.expand = expand
        self.d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank)
        self.use_fast_path = use_fast_path
        self.layer_idx = layer_idx

        self.in_proj = nn.Linear(d_model, self.d_inner * 2, bias=bias, **factory)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, kernel_size=d_conv, groups=self.d_inner,
                                padding=d_conv - 1, bias=conv_bias, **factory)
        self.act = nn.SiLU()
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False, **factory)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True, **factory)

        std = self.dt_rank**-0.5 * dt_scale
        with torch.no_grad():
            if dt_init == "constant":
                nn.init.constant_(self.dt_proj.weight, std)
            elif dt_init == "random":
                nn.init.uniform_(self.dt_proj.weight, -std, std)
            else:
                raise ArgumentValueError(f"tfun.nn.Mamba: dt_init must be 'random' or 'constant', got {dt_init!r}.")
            dt = torch.exp(
                torch.rand(self.d_inner, **factory) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
            ).clamp(min=dt_init_floor)
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.dt_proj.bias._no_reinit = True  # type: ignore[attr-defined]

        A = torch.arange(1, d_state + 1, dtype=torch.float32, device=device).repeat(self.d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A).to(dtype or torch.get_default_dtype()))
        self.A_log._no_weight_decay = True  # type: ignore[attr-defined]
        self.D = nn.Parameter(torch.ones(self.d_inner, **factory))
        self.D._no_weight_decay = True  # type: ignore[attr-defined]
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **factory)

    def _check(self, x: Any, ndims: tuple[int, ...], layout: str) -> Tensor:
        return check_input("tfun.nn.Mamba", x, ndims=ndims, features=self.d_model, dtype=self.in_proj.weight.dtype,
                           layout=layout)

    def forward(self, hidden_states: Float[Tensor, "batch length d_model"]) -> Float[Tensor, "batch length d_model"]:
        """Parallel (training) mode.

        **Arguments:**

        - `hidden_states`: `(batch, length, d_model)`.

        **Returns:** `(batch, length, d_model)`.
        """
        x = self._check(hidden_states, (3,), "(batch, length, d_model)")
        L = x.shape[1]
        xz = self.in_proj(x).transpose(1, 2)  # (b, 2 d_inner, l)
        x_in, z = xz.chunk(2, dim=1)
        x_in = self.act(self.conv1d(x_in)[..., :L])
        x_dbl = self.x_proj(x_in.transpose(1, 2))  # (b, l, r + 2n)
        dt, B, C = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = F.linear(dt, self.dt_proj.weight).transpose(1, 2)  # (b, d_inner, l)
        ct = torch.promote_types(self.A_log.dtype, torch.float32)
        A = -torch.exp(self.A_log.to(ct))
        y = selective_scan(x_in, dt, A, B.transpose(1, 2), C.transpose(1, 2), self.D.to(ct), z=z,
                           delta_bias=self.dt_proj.bias.to(ct), delta_softplus=True)
        assert isinstance(y, Tensor)
        return self.out_proj(y.transpose(1, 2))

    def init_state(self, batch_size: int, device: Any = None, dtype: Any = None) -> MambaState:
        """Zero state for `step`: `(conv_state (batch, d_inner, d_conv), ssm_state (batch, d_inner, d_state))`.

        **Arguments:**

        - `batch_size`: batch size.
        - `device`, `dtype`: default to the parameters'.

        **Returns:** the pair of zero tensors.
        """
        device = device or self.in_proj.weight.device
        dtype = dtype or self.in_proj.weight.dtype
        return (torch.zeros(batch_size, self.d_inner, self.d_conv, device=device, dtype=dtype),
                torch.zeros(batch_size, self.d_inner, self.d_state, device=device, dtype=dtype))

    def step(
        self, x_t: Float[Tensor, "batch d_model"], state: MambaState
    ) -> tuple[Float[Tensor, "batch d_model"], MambaState]:
        """Recurrent (inference) mode: one token, the same function as `forward` one position at a time.

        **Arguments:**

        - `x_t`: `(batch, d_model)`.
        - `state`: `(conv_state, ssm_state)` from `init_state` or a previous `step`.

        **Returns:** `(y_t (batch, d_model), new_state)`.
        """
        x_t = self._check(x_t, (2,), "(batch, d_model)")
        b = x_t.shape[0]
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            raise ArgumentValueError("tfun.nn.Mamba.step: state must be the pair (conv_state, ssm_state) from init_state.")
        conv_state = check_state("tfun.nn.Mamba.step", "conv_state", state[0], (b, self.d_inner, self.d_conv))
        ssm_state = check_state("tfun.nn.Mamba.step", "ssm_state", state[1], (b, self.d_inner, self.d_state))
        x, z = self.in_proj(x_t).chunk(2, dim=-1)  # (b, d_inner)
        conv_state = torch.cat([conv_state[:, :, 1:], x.unsqueeze(-1)], dim=-1)
        x = (conv_state * self.conv1d.weight[:, 0, :]).sum(-1)
        if self.conv1d.bias is not None:
            x = x + self.conv1d.bias
        x = self.act(x)
        dt, B, C = torch.split(self.x_proj(x), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        ct = torch.promote_types(x.dtype, torch.float32)
        dt = F.softplus(F.linear(dt, self.dt_proj.weight).to(ct) + self.dt_proj.bias.to(ct))
        A = -torch.exp(self.A_log.to(ct))
        dA = torch.exp(dt.unsqueeze(-1) * A)
        dBx = (dt * x.to(ct)).unsqueeze(-1) * B.to(ct).unsqueeze(1)
        h = ssm_state.to(ct) * dA + dBx
        y = (h * C.to(ct).unsqueeze(1)).sum(-1) + self.D.to(ct) * x.to(ct)
        y = (y * F.silu(z.to(ct))).to(x_t.dtype)
        return self.out_proj(y), (conv_state, h.to(ssm_state.dtype))
