"""Data-parallel training of a tfun.nn model with jitted layers, under DDP or FSDP2, launched by torchrun.

    torchrun --standalone --nproc_per_node 2 examples/train_distributed.py           # DDP, gloo on the CPU
    torchrun --standalone --nproc_per_node 2 examples/train_distributed.py --fsdp2   # FSDP2 (fully_shard)
    python examples/train_distributed.py --smoke                         # launches torchrun itself

JAX's `pmap` maps to PyTorch's own engine: each rank trains on its shard of the batch, the
gradients are averaged across ranks (DDP) or reduce-scattered into parameter shards (FSDP2).
`tfun.jit` goes on the layers *inside* the wrapper: the wrappers' hooks are not traceable as one
graph. The task: predict the running mean of a noisy signal with an LSTM and a linear head.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys

import torch
import torch.distributed as dist

import tfun


class Net(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lstm = tfun.nn.LSTM(1, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


def batch(n: int, length: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, length, 1, generator=gen)
    y = x.cumsum(1) / torch.arange(1, length + 1).view(1, -1, 1)
    return x, y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fsdp2", action="store_true", help="shard with FSDP2 instead of DDP")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--smoke", action="store_true", help="a few steps, and launch torchrun if not under it")
    args = ap.parse_args()
    if "RANK" not in os.environ:  # not under torchrun: launch two processes of this script
        # One machine, so everything goes over the loopback interface: the ranks meet at
        # 127.0.0.1 (--local-addr; torchrun otherwise publishes the address the hostname
        # resolves to, which in a sandbox without network may be unreachable, and every rank
        # then waits out the process-group timeout), and gloo's own connections use `lo`.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
               "--nproc_per_node", "2", *sys.argv]
        env = dict(os.environ)
        if os.path.exists("/sys/class/net/lo"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        raise SystemExit(subprocess.call(cmd, env=env))
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    # The wrapped model lives inside train() and is gone when it returns, before the process
    # group is destroyed. Freed later (at exit), DDP's reducer would drop gloo's process
    # group while holding the GIL, and gloo's worker thread, still releasing the last
    # collective's tensors, would wait for that GIL forever (seen under load).
    first, last, check = train(args.fsdp2, 10 if args.smoke else args.steps, rank, world)
    # every rank must hold the same model: compare a checksum of the (gathered) parameters
    gathered = [torch.zeros_like(check) for _ in range(world)]
    dist.all_gather(gathered, check)
    if rank == 0:
        mode = "FSDP2" if args.fsdp2 else "DDP"
        print(f"{mode}, {world} ranks: loss {first:.4f} -> {last:.4f}; ranks agree: {all(torch.equal(g, check) for g in gathered)}")
    dist.barrier()  # lets gloo shut down cleanly afterwards
    dist.destroy_process_group()


def train(fsdp2: bool, steps: int, rank: int, world: int) -> tuple[float, float, torch.Tensor]:
    """Train on this rank's shard; returns the first and last mean loss over the ranks and a
    checksum of the final parameters."""
    torch.manual_seed(0)  # the same initial parameters on every rank
    model = Net(16)
    model.lstm.forward = tfun.jit(model.lstm.forward)  # one compiled graph for the LSTM's scan
    if fsdp2:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.lstm)
        fully_shard(model)
        net: torch.nn.Module = model
    else:
        net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank draws its own shard of data
    first = last = 0.0
    for step in range(steps):
        x, y = batch(32 // world, 24, gen)
        loss = torch.nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        last = mean.item() / world
        first = last if step == 0 else first
        if rank == 0 and (step % 50 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {last:.4f}", flush=True)
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return first, last, torch.stack([p.detach().double().sum() for p in full]).sum().reshape(1)


if __name__ == "__main__":
    main()
