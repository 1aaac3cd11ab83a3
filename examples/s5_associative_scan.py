"""An S5 layer with `lax.associative_scan` (the paper's section 3, "State-Space Models").

S5 (Smith et al., 2023) runs the linear recurrence `x_t = A x_{t-1} + B u_t` with a
diagonal complex `A`. Because composing two steps of an affine recurrence is associative,

    (A_i, b_i) . (A_j, b_j) = (A_j * A_i, A_j * b_i + b_j)        # the paper's s5_operator

the whole sequence can be computed with `associative_scan` in O(log T) sequential steps
instead of T. This script writes the layer from scratch, checks it (and its gradients)
against the sequential `lax.scan` form, times both for several lengths, and trains it
briefly. The library layer is `tfun.nn.S5`.

Run: python examples/s5_associative_scan.py [--smoke]
"""

import argparse
import math
import time

import torch

from tfun import lax


def s5_operator(x, y):
    A_i, Bu_i = x
    A_j, Bu_j = y
    return A_j * A_i, A_j * Bu_i + Bu_j


class S5(torch.nn.Module):
    """A minimal S5 layer: H input features, P complex state modes, ZOH discretization."""

    def __init__(self, H, P):
        super().__init__()
        self.Lambda_re = torch.nn.Parameter(torch.full((P,), -0.5))
        self.Lambda_im = torch.nn.Parameter(math.pi * torch.arange(P, dtype=torch.float32))
        self.B = torch.nn.Parameter(torch.randn(P, H, 2) / math.sqrt(2 * H))
        self.C = torch.nn.Parameter(torch.randn(H, P, 2) / math.sqrt(2 * P))
        self.D = torch.nn.Parameter(torch.randn(H))
        self.log_step = torch.nn.Parameter(torch.log(torch.linspace(1e-3, 1e-1, P)))

    def discretize(self):
        Lambda = torch.complex(self.Lambda_re, self.Lambda_im)
        Lambda_bar = torch.exp(Lambda * self.log_step.exp())
        B_bar = ((Lambda_bar - 1) / Lambda)[:, None] * torch.view_as_complex(self.B)
        return Lambda_bar, B_bar

    def forward(self, u, parallel=True):  # u: (T, H) real
        Lambda_bar, B_bar = self.discretize()
        Bu = u.to(B_bar.dtype) @ B_bar.T  # (T, P)
        if parallel:
            A = Lambda_bar.expand(u.shape[0], -1)
            _, xs = lax.associative_scan(s5_operator, (A, Bu))
        else:
            def step(x, bu):
                x = Lambda_bar * x + bu
                return x, x

            _, xs = lax.scan(step, torch.zeros_like(Bu[0]), Bu)
        return (xs @ torch.view_as_complex(self.C).T).real + self.D * u


def bench(fn, reps):
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few-second run for CI")
    args = parser.parse_args()
    torch.manual_seed(0)
    H, P = 8, 20  # the paper's state dimension is 20
    layer = S5(H, P)

    # 1. associative_scan == sequential scan, values and gradients
    u = torch.randn(128, H)
    y_par = layer(u, parallel=True)
    y_seq = layer(u, parallel=False)
    g_par = torch.autograd.grad(y_par.square().sum(), list(layer.parameters()))
    g_seq = torch.autograd.grad(y_seq.square().sum(), list(layer.parameters()))
    print(f"max |y_assoc - y_scan|       = {float((y_par - y_seq).abs().max().detach()):.2e}")
    print(f"max |grad_assoc - grad_scan| = {max(float((a - b).abs().max()) for a, b in zip(g_par, g_seq)):.2e}")

    # 2. timing, forward + backward, eager on this machine
    lengths = [64, 256] if args.smoke else [256, 1024, 4096]
    reps = 1 if args.smoke else 3
    print(f"\n{'T':>6} {'associative_scan':>18} {'scan':>10}   (ms, forward+backward)")
    for T in lengths:
        u = torch.randn(T, H)
        t_par = bench(lambda: layer(u, parallel=True).sum().backward(), reps)
        t_seq = bench(lambda: layer(u, parallel=False).sum().backward(), reps)
        print(f"{T:>6} {t_par:>18.1f} {t_seq:>10.1f}")

    # 3. a few training steps: predict a moving average of the input
    steps = 5 if args.smoke else 200
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    u = torch.randn(256, H)
    target = torch.cumsum(u, 0) / torch.arange(1, 257)[:, None]
    for step in range(steps):
        loss = (layer(u) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % max(steps // 4, 1) == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {loss.item():.5f}")


if __name__ == "__main__":
    main()
