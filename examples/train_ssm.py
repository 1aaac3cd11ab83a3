"""Train two state-space models, `tfun.nn.LRU` and `tfun.nn.Mamba`, on selective copying, on the CPU.

Selective copying (Gu & Dao 2023, §3.1): a sequence of blanks holds `n_memorize` data tokens at
random positions, followed by `n_memorize` markers at which the model must emit the data tokens
in order. Mamba's input-dependent (selective) state update solves it; a time-invariant linear
recurrence such as the LRU finds it harder. The loss is `tfun.nn.chunked_cross_entropy`, which
never materializes the logits. After training, the Mamba model also decodes one sequence
token by token with `step` and checks it against the parallel forward.

    python examples/train_ssm.py                 # about a minute on a laptop CPU
    python examples/train_ssm.py --smoke         # a few seconds (CI)

Writes `train_ssm_loss.png` (both loss curves) into `--out` (default `examples/out/`).
"""

from __future__ import annotations

import argparse
import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import tfun  # noqa: E402
from _tasks import selective_copy_batch  # noqa: E402  (examples/_tasks.py)


class Block(torch.nn.Module):
    """Pre-norm residual block around one sequence layer."""

    def __init__(self, layer: torch.nn.Module, d: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.layer(self.norm(x))

    def step(self, x: torch.Tensor, state):
        y, state = self.layer.step(self.norm(x), state)
        return x + y, state


class Model(torch.nn.Module):
    def __init__(self, kind: str, n_tokens: int, d: int, depth: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(n_tokens + 2, d)
        make = {
            "LRU": lambda: tfun.nn.LRU(d, d, r_min=0.9, r_max=0.999, max_phase=3.14 / 10),
            "Mamba": lambda: tfun.nn.Mamba(d, d_state=8, d_conv=4, expand=2),
        }[kind]
        self.blocks = torch.nn.ModuleList(Block(make(), d) for _ in range(depth))
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, n_tokens + 1)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.norm(h)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Token-by-token recurrent mode (the `step` API); returns the final normed hidden states."""
        states = [b.layer.init_state(x.shape[0]) for b in self.blocks]
        outs = []
        for t in range(x.shape[1]):
            h = self.embed(x[:, t])
            for i, b in enumerate(self.blocks):
                h, states[i] = b.step(h, states[i])
            outs.append(self.norm(h))
        return torch.stack(outs, 1)


def train(kind: str, cfg: dict, steps: int, seed: int) -> tuple[list[float], float, Model]:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = Model(kind, cfg["n_tok"], cfg["d"], cfg["depth"])
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    losses, accs = [], []
    bar = tqdm(range(steps), desc=f"tfun.nn.{kind} selective copy", mininterval=1.0)
    for _ in bar:
        x, y = selective_copy_batch(cfg["batch"], cfg["length"], cfg["n_mem"], cfg["n_tok"], gen)
        h = model.hidden(x)[:, -cfg["n_mem"]:]
        loss = tfun.nn.chunked_cross_entropy(h, model.head.weight, y, model.head.bias, chunk_size=64)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            acc = (model.head(h).argmax(-1) == y).float().mean().item()
        losses.append(loss.item())
        accs.append(acc)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.2f}")
    tail = accs[-20:]
    return losses, sum(tail) / len(tail), model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=700, help="training steps per model (about 30 s each on a 2-core CPU)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes and 3 steps, for CI")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cfg = dict(length=24, n_mem=3, n_tok=6, d=32, depth=2, batch=32, lr=3e-3)
    steps = args.steps
    if args.smoke:
        cfg.update(length=8, n_mem=2, n_tok=4, d=8, depth=1, batch=4)
        steps = min(steps, 3)
    curves = {}
    for kind in ("LRU", "Mamba"):
        t0 = time.perf_counter()
        losses, acc, model = train(kind, cfg, steps, args.seed)
        curves[kind] = losses
        print(f"{kind}: final loss {losses[-1]:.4f}, accuracy (last 20 steps) {acc:.3f}, "
              f"{time.perf_counter() - t0:.1f}s")
    # recurrent decoding of the last model equals its parallel forward
    x, _ = selective_copy_batch(2, cfg["length"], cfg["n_mem"], cfg["n_tok"], torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = (model.decode(x) - model.hidden(x)).abs().max().item()
    print(f"Mamba step-mode decode vs parallel forward: max abs difference {err:.2e}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "train_ssm_loss.png")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for kind, losses in curves.items():
        ax.plot(losses, label=f"tfun.nn.{kind}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title(f"Selective copying (L={cfg['length']}, K={cfg['n_mem']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
