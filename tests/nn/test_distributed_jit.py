"""A jitted training step under DDP and FSDP2 (gloo, two CPU processes) trains exactly like one process.

`pmap`/`shard_map` users move to PyTorch's own engine: `tfun.jit` goes on the layers *inside*
the wrapper (the wrappers' hooks are not traceable as one graph). Each rank trains on half the
batch; the averaged gradients and the parameters after the steps must equal a single process
training on the whole batch, eagerly, in float64.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import tfun

from . import _dist

STEPS, BATCH, T, IN = 2, 4, 5, 3


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = tfun.nn.LSTM(IN, 5, batch_first=True, dtype=torch.float64)
        self.head = torch.nn.Linear(5, 1, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(BATCH, T, IN, dtype=torch.float64, generator=g), torch.randn(BATCH, T, 1, dtype=torch.float64, generator=g)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model: torch.nn.Module, net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[list, list]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    for _ in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        grads.append([_full(p.grad).detach().clone() for p in model.parameters()])
        opt.step()
    return grads, [_full(p).detach().clone() for p in model.parameters()]


def _worker(rank: int, world: int, store: str, mode: str, out_dir: str) -> None:
    _dist.init(rank, world, store)
    try:
        # the wrapped model lives in _run and is freed before the group is destroyed (see
        # tests/nn/_dist.py: freed later, DDP's reducer can deadlock gloo's shutdown)
        _run(rank, world, mode, out_dir)
    finally:
        dist.destroy_process_group()


def _run(rank: int, world: int, mode: str, out_dir: str) -> None:
    torch.manual_seed(0)
    model = Net()
    model.lstm.forward = tfun.jit(model.lstm.forward, backend="aot_eager")  # jit inside the wrapper
    if mode == "ddp":
        net: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # a CPU mesh named, as FSDP2 otherwise builds its mesh on CUDA wherever CUDA is present
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model.lstm, mesh=mesh)
        fully_shard(model, mesh=mesh)
        net = model
    x, y = _data()
    half = BATCH // world
    sl = slice(rank * half, (rank + 1) * half)
    grads, params = _train(model, net, x[sl], y[sl])
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]  # the jitted layer really compiled
    torch.save((grads, params, graphs), os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_jitted_layers_train_under_ddp_and_fsdp2_like_one_process(mode: str, tmp_path) -> None:
    if mode == "fsdp2":
        pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 needs torch.distributed.fsdp.fully_shard")
    torch.manual_seed(0)
    ref = Net()
    ref_grads, ref_params = _train(ref, ref, *_data())
    _dist.spawn(_worker, (2, _dist.rendezvous(tmp_path), mode, str(tmp_path)))
    for rank in range(2):
        grads, params, graphs = torch.load(tmp_path / f"rank{rank}.pt")
        assert graphs >= 1, "the jitted layer ran without compiling"
        for step_ref, step in zip(ref_grads, grads):
            for a, b in zip(step_ref, step):
                torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-11)
        for a, b in zip(ref_params, params):
            torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-11)
