"""Two-process gloo runs on one CPU machine, bounded in time.

`spawn` starts `nprocs` processes of `fn(rank, *args)`; each calls `init(rank, world, store)`
first, with a file rendezvous (`rendezvous(tmp_path)`), on the loopback interface: gloo otherwise connects the ranks through
the address the machine's hostname resolves to, which in a sandbox without network (CI) may be
unreachable, and then a rank waits out gloo's default timeout of 30 minutes. Here a rank that
cannot reach the other fails within `TIMEOUT_S`, and a run that overruns is killed and fails.

A worker frees its DDP-wrapped model before `dist.destroy_process_group()` (train in a helper
function that returns). Freed afterwards, DDP's reducer drops the last reference to gloo's
process group while holding the GIL; its destructor joins gloo's worker thread, which may still
be releasing the last collective's tensors and waits for the GIL: a deadlock, seen under load.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 120


def _loopback_env() -> dict[str, str]:
    return {"GLOO_SOCKET_IFNAME": "lo"} if os.path.exists("/sys/class/net/lo") else {}


def rendezvous(tmp_path: Any) -> str:
    """A fresh rendezvous file for one run (`init`'s `store`)."""
    return os.path.join(str(tmp_path), "rendezvous")


def init(rank: int, world: int, store: str) -> None:
    """In a spawned process: join the gloo group through the file `store`, on the loopback
    interface. A file rendezvous needs no port chosen in advance: a port picked free and
    released before the ranks bind it can be taken meanwhile by another test's gloo
    connections (two xdist workers run these tests side by side), and the ranks then wait on
    the wrong listener."""
    # a rank still running after TIMEOUT_S prints every thread's stack (to the test's
    # captured stderr) and exits, so a hang shows where it waits
    faulthandler.dump_traceback_later(TIMEOUT_S, exit=True)
    os.environ.update(_loopback_env())
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )


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
