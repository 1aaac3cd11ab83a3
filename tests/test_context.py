"""tfun/_context.py: where a call runs. Every answer about the torch.func transform stack
comes from one reader, `transform_stack`."""

from __future__ import annotations

import torch

from tfun import _context


def _answers():
    return (
        _context.transform_stack(),
        _context.forward_mode_active(),
        _context.reverse_mode_active(),
        _context.forward_mode_depth(),
        _context.functorch_active(),
    )


def _probe(seen):
    def f(x):
        seen.append(_answers())
        return x.sin().sum()

    return f


def test_no_transform():
    assert _answers() == ((), False, False, 0, False)


def test_stacks_of_transforms_agree_with_transform_stack():
    x = torch.randn(2, 3)
    seen = []
    torch.func.grad(_probe(seen))(x[0])
    torch.func.vmap(torch.func.grad(_probe(seen)))(x)
    torch.func.jvp(_probe(seen), (x[0],), (x[0],))
    torch.func.jvp(lambda y: torch.func.jvp(_probe(seen), (y,), (y,))[1], (x[0],), (x[0],))
    torch.func.vmap(lambda y: torch.func.jvp(torch.func.grad(_probe(seen)), (y,), (y,))[1])(x)
    stacks = [s[0] for s in seen]
    kinds = [tuple(k for k, _ in s) for s in stacks]
    assert kinds == [("Grad",), ("Vmap", "Grad"), ("Jvp",), ("Jvp", "Jvp"), ("Vmap", "Jvp", "Grad")]
    for stack in stacks:  # levels increase outward-in
        levels = [lvl for _, lvl in stack]
        assert levels == sorted(levels) and len(set(levels)) == len(levels)
    for stack, fwd, rev, depth, active in seen:
        names = [k for k, _ in stack]
        assert active
        assert fwd == ("Jvp" in names)
        assert rev == ("Grad" in names)
        assert depth == names.count("Jvp")


def test_autocast_state_is_restored_whatever_is_on_now():
    """`autocast_state` / `autocast_restored`: a computation run again later (a checkpoint's
    recompute, a custom rule in the backward) runs under the state recorded, on or off."""
    a, b = torch.ones(2, 2), torch.ones(2, 2)
    off = _context.autocast_state([a.device])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        on = _context.autocast_state()
        with _context.autocast_restored(off):
            assert (a @ b).dtype == torch.float32
        with _context.autocast_restored(None):
            assert (a @ b).dtype == torch.bfloat16
    assert on[0][0] == ("cpu", True, torch.bfloat16) and off[0][0][1] is False
    with _context.autocast_restored(on):
        assert (a @ b).dtype == torch.bfloat16
    assert (a @ b).dtype == torch.float32
