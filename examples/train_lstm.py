"""Train `tfun.nn.LSTM` on selective copying, a synthetic long-range memory task, on the CPU.

Selective copying (Gu & Dao 2023, §3.1): a sequence of blanks holds `n_memorize` data tokens at
random positions; after it come `n_memorize` marker tokens, at which the model must emit the data
tokens in order. Only the marker positions are scored.

    python examples/train_lstm.py                 # about a minute on a laptop CPU
    python examples/train_lstm.py --smoke         # a few seconds (CI)
    python examples/train_lstm.py --steps 500 --out /tmp/lstm

Writes `train_lstm_loss.png` (loss curve) into `--out` (default `examples/out/`).
"""

from __future__ import annotations

import argparse
import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

import tfun  # noqa: E402
from _tasks import selective_copy_batch  # noqa: E402  (examples/_tasks.py)


class Model(torch.nn.Module):
    def __init__(self, n_tokens: int, d: int, layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(n_tokens + 2, d)
        self.rnn = tfun.nn.LSTM(d, d, num_layers=layers, batch_first=True)
        self.head = torch.nn.Linear(d, n_tokens + 1)

    def forward(self, x: torch.Tensor, n_out: int) -> torch.Tensor:
        h, _ = self.rnn(self.embed(x))
        return self.head(h[:, -n_out:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--smoke", action="store_true", help="tiny sizes and 3 steps, for CI")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    length, n_mem, n_tok, d, layers, batch, steps = 24, 3, 6, 48, 1, 32, args.steps
    if args.smoke:
        length, n_mem, n_tok, d, batch, steps = 8, 2, 4, 8, 4, min(args.steps, 3)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    model = Model(n_tok, d, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    losses, accs = [], []
    t0 = time.perf_counter()
    bar = tqdm(range(steps), desc="tfun.nn.LSTM selective copy", mininterval=1.0)
    for _ in bar:
        x, y = selective_copy_batch(batch, length, n_mem, n_tok, gen)
        logits = model(x, n_mem)
        loss = F.cross_entropy(logits.reshape(-1, n_tok + 1), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        acc = (logits.argmax(-1) == y).float().mean().item()
        losses.append(loss.item())
        accs.append(acc)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.2f}")
    elapsed = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "train_lstm_loss.png")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, label="cross-entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"tfun.nn.LSTM, selective copying (L={length}, K={n_mem})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    tail = accs[-20:]
    print(f"final loss {losses[-1]:.4f}, accuracy (last {len(tail)} steps) {sum(tail) / len(tail):.3f}, "
          f"{elapsed:.1f}s, plot: {path}")


if __name__ == "__main__":
    main()
