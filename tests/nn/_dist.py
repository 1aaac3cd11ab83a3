"""Two-process gloo runs on one CPU machine, bounded in time.

`spawn` starts `nprocs` processes of `fn(rank, *args)`; each calls `init(rank, world, port)`
first. Both pin everything to the loopback interface: gloo otherwise connects the ranks through
the address the machine's hostname resolves to, which in a sandbox without network (CI) may be
unreachable, and then a rank waits out gloo's default timeout of 30 minutes. Here a rank that
cannot reach the other fails within `TIMEOUT_S`, and a run that overruns is killed and fails.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loopback_env() -> dict[str, str]:
    env = {"MASTER_ADDR": "127.0.0.1"}
    if os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def init(rank: int, world: int, port: int) -> None:
    """In a spawned process: join the gloo group on the loopback interface."""
    os.environ.update(_loopback_env(), MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))


def spawn(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int = 2) -> None:
    """`mp.spawn(fn, args, nprocs)` that fails (and kills its processes) after `2 * TIMEOUT_S`."""
    ctx = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + 2 * TIMEOUT_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"the {nprocs} gloo processes did not finish within {2 * TIMEOUT_S} s")
