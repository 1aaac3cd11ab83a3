"""DDP over gloo with two CPU processes: tfun.nn.LSTM + an SSM train exactly like one process."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import tfun

from . import _dist

STEPS, BATCH, T, IN = 2, 4, 6, 3


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = tfun.nn.LSTM(IN, 5, batch_first=True, dtype=torch.float64)
        self.ssm = tfun.nn.LRU(5, 4, r_min=0.5, r_max=0.95, dtype=torch.float64)
        self.head = torch.nn.Linear(5, 1, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ssm(self.lstm(x)[0]))


def _data():
    g = torch.Generator().manual_seed(123)
    return torch.randn(BATCH, T, IN, dtype=torch.float64, generator=g), torch.randn(BATCH, T, 1, dtype=torch.float64, generator=g)


def _train(model, x, y, wrap=lambda m: m):
    net = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads, [p.detach().clone() for p in model.parameters()]


def _worker(rank: int, world: int, store: str, out_dir: str) -> None:
    _dist.init(rank, world, store)
    try:
        torch.manual_seed(0)
        model = Net()
        x, y = _data()
        half = BATCH // world
        sl = slice(rank * half, (rank + 1) * half)
        result = _train(model, x[sl], y[sl], wrap=lambda m: torch.nn.parallel.DistributedDataParallel(m))
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ddp_gloo_matches_single_process(tmp_path):
    torch.manual_seed(0)
    ref_grads, ref_params = _train(Net(), *_data())
    _dist.spawn(_worker, (2, _dist.rendezvous(tmp_path), str(tmp_path)))
    for rank in range(2):
        grads, params = torch.load(tmp_path / f"rank{rank}.pt")
        for step_ref, step in zip(ref_grads, grads):
            for a, b in zip(step_ref, step):
                torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
        for a, b in zip(ref_params, params):
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
