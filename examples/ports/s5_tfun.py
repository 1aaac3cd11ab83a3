"""An S5 layer (Smith et al., 2023) with `lax.associative_scan` (tfun side of the port).

Run: python examples/ports/s5_tfun.py
"""

import math

import torch

from tfun import lax

L, H, P = 64, 4, 8  # sequence length, features, state size

# Deterministic parameters: diagonal complex state matrix, complex B and C.
n = torch.arange(P, dtype=torch.float32)
Lambda = -0.5 + 1j * math.pi * n
B = (torch.cos(torch.arange(P * H, dtype=torch.float32)).reshape(P, H)
     + 1j * torch.sin(torch.arange(P * H, dtype=torch.float32)).reshape(P, H)) / math.sqrt(H)
C = (torch.sin(torch.arange(H * P, dtype=torch.float32)).reshape(H, P)
     - 1j * torch.cos(torch.arange(H * P, dtype=torch.float32)).reshape(H, P)) / math.sqrt(P)
D = torch.linspace(0.5, 1.0, H)
log_step = torch.log(torch.linspace(0.01, 0.1, P))


def discretize_zoh(Lambda, B, step):
    Lambda_bar = torch.exp(Lambda * step)
    B_bar = ((Lambda_bar - 1) / Lambda)[:, None] * B
    return Lambda_bar, B_bar


def binary_operator(q_i, q_j):
    """The S5 operator: composes two steps of x_k = A_k x_{k-1} + Bu_k."""
    A_i, b_i = q_i
    A_j, b_j = q_j
    return A_j * A_i, A_j * b_i + b_j


def s5_layer(u):
    Lambda_bar, B_bar = discretize_zoh(Lambda, B, torch.exp(log_step))
    Lambda_elements = Lambda_bar * torch.ones((u.shape[0], P), dtype=Lambda_bar.dtype)
    Bu_elements = u.to(torch.complex64) @ B_bar.T
    _, xs = lax.associative_scan(binary_operator, (Lambda_elements, Bu_elements))
    return (xs @ C.T).real + D * u


u = torch.sin(0.1 * torch.arange(L, dtype=torch.float32)[:, None] * (1 + torch.arange(H, dtype=torch.float32)))
y = s5_layer(u)
print("y shape", tuple(y.shape))
print(f"y sum {float(y.sum()):.5f}  y abs mean {float(torch.abs(y).mean()):.5f}")
print("y[-1]", " ".join(f"{float(v):.5f}" for v in y[-1]))
