"""Shape-dependent attention masks with `lax.cond` (the paper's appendix F.1).

A decoder builds its attention mask differently in the two phases of generation:

- *prefill* (`seq_len > 1`): a causal mask over the new tokens, combined with the padding
  mask of the whole key sequence;
- *decoding* (`seq_len == 1`): the one new token may attend to every non-padded key, so
  only the padding mask is expanded.

Both branches return an additive mask of shape `(batch, 1, seq_len, past_len + seq_len)`,
so they satisfy the rules of `lax.cond` (same structure, dtype, shape and device). The
predicate depends on a shape; eagerly it is a Python bool, and under `torch.compile` with
dynamic shapes it would be a symbolic one, which is what `torch.cond` is for.

Run: python examples/attention_masks.py [--smoke]
"""

import argparse
import time

import torch
import torch.nn.functional as F

from tfun import lax

NEG = torch.finfo(torch.float32).min


def make_causal_mask(padding_mask, seq_len, past_len):
    """Causal + padding: query i (at absolute position past_len + i) sees keys <= it."""
    total = past_len + seq_len
    q_pos = torch.arange(seq_len)[:, None] + past_len
    k_pos = torch.arange(total)[None, :]
    allowed = (k_pos <= q_pos)[None, None] & padding_mask[:, None, None, :].bool()
    return torch.where(allowed, 0.0, NEG)


def expand_mask(padding_mask, seq_len, past_len):
    """Padding only, expanded to (batch, 1, seq_len, total)."""
    allowed = padding_mask[:, None, None, :].bool().expand(-1, 1, seq_len, past_len + seq_len)
    return torch.where(allowed, 0.0, NEG)


def attention_mask(padding_mask, seq_len, past_len):
    return lax.cond(
        seq_len > 1,
        lambda m: make_causal_mask(m, seq_len, past_len),
        lambda m: expand_mask(m, seq_len, past_len),
        padding_mask,
    )


def attend(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few-second run for CI")
    args = parser.parse_args()
    torch.manual_seed(0)
    batch, heads, dim = 2, 4, 16
    prompt_len = 6 if args.smoke else 64
    new_tokens = 3 if args.smoke else 256
    # the second sequence is left-padded by 2 tokens
    padding = torch.ones(batch, prompt_len + new_tokens, dtype=torch.long)
    padding[1, :2] = 0

    # prefill: all prompt tokens at once -> causal branch
    m = attention_mask(padding[:, :prompt_len], prompt_len, 0)
    print("prefill mask", tuple(m.shape), "(causal branch); in sequence 1 (2 pad tokens) query 2 sees",
          int((m[1, 0, 2] == 0).sum()), "key(s)")
    if args.smoke:
        print((m[0, 0] == 0).int())

    # decoding: one token at a time, with a growing key cache -> padding-only branch
    k_cache = torch.randn(batch, heads, prompt_len, dim)
    v_cache = torch.randn(batch, heads, prompt_len, dim)
    t0 = time.perf_counter()
    for step in range(new_tokens):
        past = k_cache.shape[2]
        q = torch.randn(batch, heads, 1, dim)
        k_cache = torch.cat([k_cache, torch.randn(batch, heads, 1, dim)], dim=2)
        v_cache = torch.cat([v_cache, torch.randn(batch, heads, 1, dim)], dim=2)
        m = attention_mask(padding[:, : past + 1], 1, past)
        out = attend(q, k_cache, v_cache, m)
    dt = time.perf_counter() - t0
    print(f"decoded {new_tokens} tokens, last mask {tuple(m.shape)} (padding branch), "
          f"output {tuple(out.shape)}, {dt / new_tokens * 1e3:.2f} ms/token")
    # Every decoding step has a new key length, hence a new input signature, so tfun's
    # trace-time rules (which also evaluate the branch not taken, on fake tensors) run at
    # every step. Compare with a plain if/else over the same shapes:
    t0 = time.perf_counter()
    for step in range(new_tokens):
        past = prompt_len + step
        pm = padding[:, : past + 1]
        m2 = make_causal_mask(pm, 1, past) if 1 > 1 else expand_mask(pm, 1, past)
    print(f"mask building alone with a plain if/else: {(time.perf_counter() - t0) / new_tokens * 1e3:.2f} ms/token")

    # the cond picks the same mask the hand-written `if` would
    for seq_len, past in [(1, 5), (4, 0), (3, 2)]:
        pm = padding[:, : past + seq_len]
        ref = make_causal_mask(pm, seq_len, past) if seq_len > 1 else expand_mask(pm, seq_len, past)
        assert torch.equal(attention_mask(pm, seq_len, past), ref)
    print("lax.cond masks match the hand-written if/else: True")


if __name__ == "__main__":
    main()
