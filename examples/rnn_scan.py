"""An RNN with `lax.scan` (the paper's appendix F.4, "RNN").

The paper's listing, first: a classic RNN written as a Python loop and the same step
function run by `scan`, which give identical results. Then a small Elman RNN trained
with `scan` to continue a noisy sine wave, and a check that `tfun.nn.RNN` (one `scan` per
layer, torch's parameter layout) matches `torch.nn.RNN` with the same weights.

Run: python examples/rnn_scan.py [--smoke]
"""

import argparse
import time

import torch

import tfun
from tfun import lax

# --- the paper's listing ------------------------------------------------------------------
W = torch.rand(2, 4)
H = torch.rand(4, 4)


def classicRNN(init_h, x):
    h = init_h
    outs = []
    for xs in x:
        h, o = combine_fn(h, xs)
        outs.append(o)
    return h, torch.stack(outs)


def combine_fn(prev_h, xs):
    h = torch.sigmoid(torch.matmul(xs, W) + torch.matmul(prev_h, H))
    return h, h


# --- a trained Elman RNN --------------------------------------------------------------------
class ElmanRNN(torch.nn.Module):
    def __init__(self, n_in, n_hidden):
        super().__init__()
        self.W_x = torch.nn.Linear(n_in, n_hidden)
        self.W_h = torch.nn.Linear(n_hidden, n_hidden, bias=False)
        self.out = torch.nn.Linear(n_hidden, 1)

    def forward(self, xs):  # xs: (T, batch, n_in)
        def step(h, x):
            h = torch.tanh(self.W_x(x) + self.W_h(h))
            return h, self.out(h).squeeze(-1)

        h0 = torch.zeros(xs.shape[1], self.W_h.in_features)
        _, ys = lax.scan(step, h0, xs)
        return ys  # (T, batch)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few-second run for CI")
    args = parser.parse_args()
    torch.manual_seed(0)

    x = torch.rand(4, 2)
    init_h = torch.zeros(4)
    h_loop, out_loop = classicRNN(init_h, x)
    h_scan, out_scan = lax.scan(combine_fn, init_h, x)
    print("paper listing: loop == scan:", torch.equal(h_loop, h_scan) and torch.equal(out_loop, out_scan))

    # Train: predict the next sample of sine waves with random phases.
    steps, T, batch = (10, 50, 8) if args.smoke else (400, 100, 32)
    model = ElmanRNN(1, 32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    t0 = time.perf_counter()
    for step in range(steps):
        phase = torch.rand(batch) * 6.28
        t = torch.arange(T + 1)[:, None] * 0.2 + phase
        wave = torch.sin(t) + 0.05 * torch.randn(T + 1, batch)
        pred = model(wave[:-1, :, None])
        loss = (pred - wave[1:]).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % max(steps // 5, 1) == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    print(f"{steps} training steps in {time.perf_counter() - t0:.1f} s")

    # tfun.nn.RNN is a drop-in for torch.nn.RNN (same parameters), built on scan. Eagerly it
    # runs torch's fused kernel unless fused=False: here the scan, to check it against torch.
    ref = torch.nn.RNN(3, 5, num_layers=2)
    ours = tfun.nn.RNN(3, 5, num_layers=2, fused=False)
    ours.load_state_dict(ref.state_dict())
    seq = torch.randn(7, 2, 3)
    (y1, h1), (y2, h2) = ref(seq), ours(seq)
    print("tfun.nn.RNN matches torch.nn.RNN:", torch.allclose(y1, y2, atol=1e-6) and torch.allclose(h1, h2, atol=1e-6))


if __name__ == "__main__":
    main()
