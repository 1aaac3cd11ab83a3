"""Synthetic tasks shared by the training examples (a helper module, not a program)."""

import torch


def selective_copy_batch(batch: int, length: int, n_memorize: int, n_tokens: int, gen: torch.Generator):
    """Selective copying: remember `n_memorize` tokens scattered among blanks, then recall them.

    Inputs are (batch, length + n_memorize) and targets (batch, n_memorize); 0 is the blank
    token and n_tokens + 1 the recall marker.
    """
    data = torch.randint(1, n_tokens + 1, (batch, n_memorize), generator=gen)
    pos = torch.rand(batch, length, generator=gen).argsort(1)[:, :n_memorize].sort(1).values
    x = torch.zeros(batch, length + n_memorize, dtype=torch.long)
    x.scatter_(1, pos, data)
    x[:, length:] = n_tokens + 1
    return x, data
