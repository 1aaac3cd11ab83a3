"""Invalid-value clamping with `lax.cond` (the paper's section 3, "Invalid Value Clamping").

A tensor that picks up NaN or +-Inf (a division by zero, bad data) poisons everything
downstream. The fix is a data-dependent branch: repair the tensor only when it needs it.
`lax.cond` expresses that branch as one op: eagerly it is the `if`; traced by
`torch.compile` / `torch.export` it becomes one `torch.cond` node instead of a graph
break on `if x.isnan().any():`.

Run: python examples/nan_clamping.py [--smoke]
"""

import argparse
import time

import torch

from tfun import lax

MAX_V = 5.0


def repair(x):
    """Replace NaN by 0 and clamp to [-MAX_V, MAX_V], but only if x has a bad value."""
    return lax.cond(
        torch.isinf(x).any() | torch.isnan(x).any(),
        lambda v: torch.nan_to_num(v, nan=0.0).clamp(-MAX_V, MAX_V),
        lambda v: v.clone(),
        x,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few-second run for CI")
    args = parser.parse_args()
    steps = 20 if args.smoke else 2000
    torch.manual_seed(0)

    print(repair(torch.tensor([1.0, float("inf"), float("nan"), -3.0, float("-inf")])))
    print(repair(torch.tensor([1.0, 2.0, 3.0])))

    # A toy training loop in which every 7th batch carries a corrupted feature. Without the
    # repair, one bad batch makes the weights NaN for good.
    def run(fix):
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        repaired = 0
        for step in range(steps):
            x = torch.randn(32, 8)
            if step % 7 == 3:
                x[0, step % 8] = float("inf") if step % 2 else float("nan")
            if fix:
                repaired += bool(torch.isinf(x).any() | torch.isnan(x).any())
                x = repair(x)
            loss = (model(x).squeeze(-1) - x.sum(-1).clamp(-10, 10)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return float(loss.detach()), repaired, bool(torch.isfinite(model.weight).all())

    t0 = time.perf_counter()
    loss, repaired, finite = run(fix=True)
    print(f"with lax.cond repair: {steps} steps, {repaired} batches repaired, final loss {loss:.4f}, "
          f"weights finite: {finite} ({time.perf_counter() - t0:.2f} s)")
    loss, _, finite = run(fix=False)
    print(f"without it:           final loss {loss}, weights finite: {finite}")


if __name__ == "__main__":
    main()
