"""Chunked cross-entropy with `lax.scan` (the paper's "Chunked Loss Computation", appendix F.3).

The last layer of a language model maps `rows` hidden states to `vocab` logits. The naive
loss `F.cross_entropy(hidden @ W.T + b, target)` holds all `rows x vocab` logits (and their
softmax) for the backward pass: for 4096 tokens and a 128k vocabulary that is 2 GB in
float32. The chunked loss scans over chunks of rows, computes each chunk's loss *and its
gradients in the forward pass*, accumulates the weight gradient in the scan carry, and
never holds more than one chunk's logits.

This script shows it twice: written inline with `lax.scan` (the paper's listing), and
with the library version `tfun.nn.chunked_cross_entropy`. It checks both against the
naive loss and prints the memory each keeps for the backward pass.

Run: python examples/chunked_cross_entropy.py [--smoke]
"""

import argparse
import time

import torch
import torch.nn.functional as F

import tfun
from tfun import lax


def chunked_ce_inline(hidden, weight, bias, target, chunk_size):
    """The paper's `ChunkedCE`: returns (loss, grad_hidden, grad_weight, grad_bias), all
    computed in one forward scan. `rows` must be a multiple of `chunk_size` here."""

    def chunk_loss(h, w, b, t):
        return F.cross_entropy(torch.addmm(b, h, w.t()), t, reduction="sum")

    def body(carry, xs):
        grad_w, grad_b, loss = carry
        h, t = xs
        (g_h, g_w, g_b), l = torch.func.grad_and_value(chunk_loss, argnums=(0, 1, 2))(h, weight, bias, t)
        return (grad_w + g_w, grad_b + g_b, loss + l), g_h

    n, d = hidden.shape
    chunks = n // chunk_size
    init = (torch.zeros_like(weight), torch.zeros_like(bias), torch.zeros(()))
    (grad_w, grad_b, loss), grad_h = lax.scan(
        body, init, (hidden.view(chunks, chunk_size, d), target.view(chunks, chunk_size))
    )
    return loss / n, grad_h.view(n, d) / n, grad_w / n, grad_b / n


def saved_for_backward(fn):
    """Run `fn()` and return (its result, bytes of the tensors autograd saved for backward)."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def mib(n):
    return f"{n / 2**20:8.1f} MiB"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few-second run for CI")
    args = parser.parse_args()
    rows, d, vocab, chunk = (256, 32, 1000, 64) if args.smoke else (4096, 128, 16000, 512)
    torch.manual_seed(0)
    hidden = torch.randn(rows, d, requires_grad=True)
    lin = torch.nn.Linear(d, vocab)
    target = torch.randint(0, vocab, (rows,))
    print(f"rows={rows} hidden={d} vocab={vocab} chunk_size={chunk}")

    # 1. naive: the full logits live until backward
    t0 = time.perf_counter()
    loss_ref, saved_ref = saved_for_backward(lambda: F.cross_entropy(lin(hidden), target))
    g_ref = torch.autograd.grad(loss_ref, (hidden, lin.weight, lin.bias))
    t_ref = time.perf_counter() - t0

    # 2. inline lax.scan version (gradients computed in the forward)
    t0 = time.perf_counter()
    with torch.no_grad():
        loss_in, *g_in = chunked_ce_inline(hidden, lin.weight, lin.bias, target, chunk)
    t_in = time.perf_counter() - t0

    # 3. the library version, a differentiable loss
    t0 = time.perf_counter()
    loss_lib, saved_lib = saved_for_backward(
        lambda: tfun.nn.chunked_cross_entropy(hidden, lin.weight, target, lin.bias, chunk_size=chunk)
    )
    g_lib = torch.autograd.grad(loss_lib, (hidden, lin.weight, lin.bias))
    t_lib = time.perf_counter() - t0

    def max_err(gs):
        return max(float((a - b).abs().max()) for a, b in zip(gs, g_ref))

    print(f"loss  naive {float(loss_ref.detach()):.6f}   inline scan {float(loss_in):.6f}   "
          f"tfun.nn {float(loss_lib.detach()):.6f}")
    print(f"max |grad - naive grad|: inline scan {max_err(g_in):.2e}, tfun.nn {max_err(g_lib):.2e}")
    logits_bytes = rows * vocab * 4
    print(f"logits of the whole batch:          {mib(logits_bytes)}")
    print(f"logits of one chunk:                {mib(chunk * vocab * 4)}")
    print(f"saved for backward, naive:          {mib(saved_ref)}   ({t_ref:.2f} s fwd+bwd)")
    print(f"saved for backward, chunked (tfun): {mib(saved_lib)}   ({t_lib:.2f} s fwd+bwd)")
    print(f"memory saved: {mib(saved_ref - saved_lib)} ({saved_ref / max(saved_lib, 1):.1f}x less); "
          f"inline scan took {t_in:.2f} s")
    assert max_err(g_lib) < 1e-4 and max_err(g_in) < 1e-4


if __name__ == "__main__":
    main()
