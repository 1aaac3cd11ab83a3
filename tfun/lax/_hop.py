"""Lowering of tfun.lax ops to PyTorch's control-flow higher-order operators (HOPs).

This is the ONLY module that touches torch's private HOP APIs (`torch.cond`,
`torch._higher_order_ops.while_loop`, `scan`, `map`, `associative_scan`), so that changes
between torch releases are absorbed here.

Interface used by the lax ops (arguments already validated and normalized by the op:
Python scalars in carries turned into tensors, `pred` a 0-d bool tensor, `index` a 0-d
integer tensor already clamped):

- `is_tracing() -> bool`: True when the op is being traced by torch.compile / torch.export
  and must lower to a HOP instead of running its eager Python loop.
- `cond(pred, true_fun, false_fun, operands: tuple) -> out`
- `switch(index, branches, operands: tuple) -> out`
- `while_loop(cond_fun, body_fun, init_val) -> final_val`
- `scan(f, init, xs, length: int, reverse: bool) -> (carry, ys)`
- `map(f, xs) -> ys`
- `associative_scan(fn, elems, reverse: bool, axis: int) -> out`

Until the lowering lands (issue 4), `is_tracing()` is False and the ops run their eager
implementation, which Dynamo traces by unrolling.
"""

from __future__ import annotations


def is_tracing() -> bool:
    return False
