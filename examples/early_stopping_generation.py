"""Early-stopping generation with `lax.while_loop` (the paper's appendix F.2, "Early Stopping").

A batch of sequences is generated token by token until *every* sequence has produced
the end-of-text token, or a maximum length is reached. The trip count depends on the
data, so it is a `while_loop`: the loop state is the step index, the token buffer, the
recurrent state and a per-sequence "done" mask. The toy model is a randomly initialised
GRU language model whose end-token logit grows with the position, so sequences end at
different lengths.

Sampling noise is drawn up front from a `torch.Generator` and indexed by the step inside
the body (the JAX way of splitting keys): the body stays free of side effects.

Run: python examples/early_stopping_generation.py [--smoke]
"""

import argparse
import time

import torch

from tfun import lax

EOS = 0


class TinyLM(torch.nn.Module):
    def __init__(self, vocab, dim):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.cell = torch.nn.GRUCell(dim, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def step(self, token, h, idx):
        h = self.cell(self.embed(token), h)
        logits = self.head(h)
        eos_bonus = 0.08 * idx.to(logits.dtype)  # ending becomes likelier with length
        return logits + eos_bonus * (torch.arange(logits.shape[-1]) == EOS), h


@torch.no_grad()
def generate(model, prompt, max_len, noise):
    """Returns (number of steps run, tokens (batch, max_len)), stopping when all sequences are done."""
    batch = prompt.shape[0]
    positions = torch.arange(max_len)

    def cond_fun(state):
        idx, tokens, last, h, done = state
        return (idx < max_len) & ~done.all()

    def body_fun(state):
        idx, tokens, last, h, done = state
        logits, h = model.step(last, h, idx)
        nxt = torch.argmax(logits + noise[idx], dim=-1)  # Gumbel-max sampling
        nxt = torch.where(done, torch.full_like(nxt, EOS), nxt)  # finished rows keep padding
        tokens = torch.where(positions == idx, nxt[:, None], tokens)  # no in-place writes
        return idx + 1, tokens, nxt, h, done | (nxt == EOS)

    init = (
        torch.tensor(0),
        torch.full((batch, max_len), EOS),
        prompt,
        torch.zeros(batch, model.cell.hidden_size),
        torch.zeros(batch, dtype=torch.bool),
    )
    idx, tokens, *_ = lax.while_loop(cond_fun, body_fun, init)
    return int(idx), tokens


@torch.no_grad()
def generate_python(model, prompt, max_len, noise):
    """The same loop, hand-written, as the reference."""
    tokens = torch.full((prompt.shape[0], max_len), EOS)
    last, h = prompt, torch.zeros(prompt.shape[0], model.cell.hidden_size)
    done = torch.zeros(prompt.shape[0], dtype=torch.bool)
    idx = 0
    while idx < max_len and not done.all():
        logits, h = model.step(last, h, torch.tensor(idx))
        nxt = torch.where(done, EOS, torch.argmax(logits + noise[idx], dim=-1))
        tokens[:, idx] = nxt
        last, done, idx = nxt, done | (nxt == EOS), idx + 1
    return idx, tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a few-second run for CI")
    args = parser.parse_args()
    vocab, dim, batch, max_len = (32, 16, 4, 64) if args.smoke else (256, 256, 64, 512)
    torch.manual_seed(0)
    model = TinyLM(vocab, dim)
    gen = torch.Generator().manual_seed(1)
    u = torch.rand(max_len, batch, vocab, generator=gen).clamp_min(1e-9)
    noise = -torch.log(-torch.log(u))
    prompt = torch.randint(1, vocab, (batch,), generator=gen)

    t0 = time.perf_counter()
    steps, tokens = generate(model, prompt, max_len, noise)
    t_while = time.perf_counter() - t0
    steps_ref, tokens_ref = generate_python(model, prompt, max_len, noise)
    lengths = (tokens != EOS).sum(1)
    print(f"batch {batch}, max_len {max_len}: stopped after {steps} steps "
          f"({max_len - steps} steps saved) in {t_while * 1e3:.0f} ms")
    print("sequence lengths before EOS:", lengths.tolist())
    print("first sequence:", tokens[0, : int(lengths[0]) + 1].tolist())
    print("matches the hand-written loop:", steps == steps_ref and torch.equal(tokens, tokens_ref))


if __name__ == "__main__":
    main()
