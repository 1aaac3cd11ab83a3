"""`tfun.checkpoint` (alias `remat`): rematerialization that works under `torch.func`.

Traced (`tfun.jit`, `torch.compile`) it lowers to `torch.utils.checkpoint` instead (see
`_traced_checkpoint`): Dynamo captures that as a higher-order op, while the eager
machinery below (a `TorchFunctionMode`, saved RNG states) cannot be traced.

`torch.utils.checkpoint` relies on saved-tensor hooks, which `torch.func` transforms
refuse. tfun's checkpoint is an `autograd.Function` instead: forward runs the function
without recording a graph and saves only its inputs (plus, per `policy`, some op
outputs); backward re-runs the function and differentiates it with `torch.func.vjp`.

Closed-over tensors (module parameters, captured weights, tensors of an enclosing
transform) are found by running the function under a `TorchFunctionMode` that records
every tensor an op reads which the function neither received nor produced. Those
tensors become extra inputs of the `autograd.Function`, so they receive gradients
(under `.backward()` as under `torch.func.grad`), and while the function re-runs, the
mode substitutes the Function's own inputs for them.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.func
import torch.utils._pytree as torch_pytree
from torch.overrides import TorchFunctionMode

from . import _compat, _context
from ._errors import ArgumentTypeError, ArgumentValueError, JitError, format_message
from ._funcinfo import describe
from ._grad import describe_value, is_inexact
from ._tree import Partition, partition, tree_flatten, tree_unflatten
from .lax import _hop

__all__ = ["checkpoint", "remat", "checkpoint_policies"]


# --------------------------------------------------------------------------------------
# policies
# --------------------------------------------------------------------------------------

_STATE = threading.local()


def _dot_funcs() -> set[Any]:
    F = torch.nn.functional
    T = torch.Tensor
    return {
        torch.matmul, torch.mm, torch.bmm, torch.mv, torch.dot, torch.einsum, torch.tensordot,
        torch.addmm, torch.baddbmm, torch.addbmm, torch.addmv, torch.inner, torch.outer,
        F.linear, F.bilinear, T.matmul, T.__matmul__, T.__rmatmul__, T.mm, T.bmm, T.mv, T.dot,
    }


class _Policies:
    """Named checkpoint policies, as `jax.checkpoint_policies`.

    A policy is called as `policy(func, *args, **kwargs) -> bool` for every torch function
    the checkpointed function calls (`func` is e.g. `torch.matmul` or
    `torch.nn.functional.linear`, `args`/`kwargs` its arguments). A `True` answer for a
    matrix product (`torch.matmul`/`mm`/`bmm`, `@`, `F.linear`, operands of 2+ dims) keeps
    its output from forward to backward: the recomputation reads it instead of re-running
    the product, and its gradient uses a closed-form VJP that needs only the operands.
    Every other op is recomputed whatever the policy answers (eager PyTorch cannot skip
    the producers of a saved value, so saving it would cost memory for nothing).

    Under `tfun.jit` the policy becomes torch's selective activation checkpointing and is
    asked about the ATen matrix products the traced function runs, shown as `torch.mm`,
    `torch.bmm`, `torch.addmm`, `torch.baddbmm`, `torch.addbmm`, `torch.mv`, `torch.addmv`
    or `torch.dot` (`torch.matmul`, `@`, `F.linear` and `einsum` decompose into these);
    the named policies give the same answers there.

    `checkpoint_dots` and `checkpoint_dots_with_no_batch_dims` are JAX's other names of
    `dots_saveable` and `dots_with_no_batch_dims_saveable` (the same functions).
    """

    @staticmethod
    def nothing_saveable(func: Any, *args: Any, **kwargs: Any) -> bool:
        """Save nothing but the inputs (the default: `policy=None`)."""
        return False

    @staticmethod
    def everything_saveable(func: Any, *args: Any, **kwargs: Any) -> bool:
        """Save everything: no rematerialization (equivalent to not checkpointing)."""
        return True

    @staticmethod
    def dots_saveable(func: Any, *args: Any, **kwargs: Any) -> bool:
        """Save the outputs of matrix products (`matmul`, `linear`, `einsum`, `bmm`, ...)."""
        return func in _DOTS

    @staticmethod
    def dots_with_no_batch_dims_saveable(func: Any, *args: Any, **kwargs: Any) -> bool:
        """Save the outputs of matrix products whose operands have at most 2 dimensions."""
        if func not in _DOTS:
            return False
        return all(a.ndim <= 2 for a in args if isinstance(a, torch.Tensor))


# JAX's older names of the same policies
_Policies.checkpoint_dots = staticmethod(_Policies.dots_saveable)  # type: ignore[attr-defined]
_Policies.checkpoint_dots_with_no_batch_dims = staticmethod(_Policies.dots_with_no_batch_dims_saveable)  # type: ignore[attr-defined]

_DOTS = _dot_funcs()
checkpoint_policies = _Policies()


# --------------------------------------------------------------------------------------
# the recording / substituting mode
# --------------------------------------------------------------------------------------


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [x for x in torch_pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


class _Mode(TorchFunctionMode):
    """One run of the checkpointed function.

    - `discover`: record tensors read by ops that are neither inputs nor produced inside.
    - `subst`: `id(external) -> replacement` applied to every op's arguments.
    - `policy`: in a saving run, op outputs for which it answers True are collected.
    - `replay`: in a recomputing run, `{product index: (signature, saved outputs)}` stand in
      for those ops.

    Only the matrix products (the ops a policy may save, `_replay_kind`) are numbered, so
    that the two runs agree on the numbers although the saving run may call more torch
    functions than the recomputation: a tfun.lax op's first call with a signature checks its
    rules (property reads, a snapshot of torch's state), later calls do not (hunt 24: a
    while_loop or switch before the products made the saved product of one op stand in for
    another, wrong gradients with no error). Each saved product also keeps its operands'
    shapes and dtypes; should a recomputation ever meet a product with others at that
    number, it stops replaying and computes every later product itself (the same values).

    A `tfun.jit` function called inside runs eagerly (`_context.in_op_recording_mode`), so
    that every op it runs is seen and numbered here.
    """

    tfun_records_ops = True

    def __init__(
        self,
        *,
        inputs: Sequence[torch.Tensor] = (),
        discover: bool = False,
        subst: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        policy: Callable[..., bool] | None = None,
        replay: dict[int, tuple[Any, list[torch.Tensor]]] | None = None,
    ) -> None:
        super().__init__()
        self.discover = discover
        self.internal: dict[int, Any] = {id(t): t for t in inputs}  # strong refs: ids stay unique
        self.externals: list[torch.Tensor] = []
        self._ext_ids: set[int] = set()
        self.subst = subst or {}
        self.policy = policy
        self.replay = replay
        self.saved: dict[int, list[torch.Tensor]] = {}
        self.signatures: dict[int, Any] = {}
        self.count = 0
        self.opaque = 0  # > 0 inside a custom function's primal run (see `custom_function_op`)
        self._prev: Any = None
        # the deepest torch.func level live at the call: a tensor wrapped deeper was made by a
        # transform inside the function (`tfun.vmap`'s batched view of an input, which no torch
        # function the mode sees creates), not read from outside it
        stack = _context.transform_stack() if discover else ()
        self.level = max((lvl for _, lvl in stack), default=-1)

    def __enter__(self) -> Any:
        self._prev = getattr(_STATE, "mode", None)
        _STATE.mode = self
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        _STATE.mode = self._prev
        return super().__exit__(*exc)

    def _map_args(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if not self.subst:
            return args, kwargs

        def sub(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                hit = self.subst.get(id(x))
                if hit is not None and hit[0] is x:
                    return hit[1]
            return x

        return torch_pytree.tree_map(sub, (args, kwargs))

    def _note(self, args: Any, kwargs: Any) -> None:
        for t in _tensor_leaves((args, kwargs)):
            ref = self.internal.get(id(t))
            if ref is t or id(t) in self._ext_ids:
                continue
            if _context.functorch_active() and _context.functorch_level(t) > self.level:
                # made inside by a torch.func transform (hunt 25, finding 1: a vmap's batched
                # view, passed to the backward as an input after its level was gone)
                continue
            self._ext_ids.add(id(t))
            self.externals.append(t)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.opaque:
            # inside a custom function called without its rule: its ops are not numbered,
            # saved or replayed (see `custom_function_op`), only discovered and substituted
            if self.discover:
                self._note(args, kwargs)
            args, kwargs = self._map_args(args, kwargs)
            out = func(*args, **kwargs)
            if self.discover:
                for t in _tensor_leaves(out):
                    self.internal[id(t)] = t
            return out
        idx = None
        if _replay_kind(func) is not None and not _any_fake((args, kwargs)):
            # (a product on fake tensors is a rules check's, such as the branch of a switch
            # not taken, run on the first call only: neither numbered nor saved)
            idx = self.count
            self.count += 1
        if self.discover:
            self._note(args, kwargs)
        args, kwargs = self._map_args(args, kwargs)
        hit = self.replay.get(idx) if self.replay is not None and idx is not None else None
        if hit is not None and hit[0] != _signature(func, args, kwargs):
            self.replay, hit = None, None  # the numbers no longer agree: compute from here on
        if hit is not None and _context.functorch_active() and _context.forward_mode_active():
            # a product under a forward-mode transform inside the function (`tfun.jvp`): computed
            # (the same values), as the replay's autograd.Function has no forward-mode rule
            # (hunt 25, finding 5a: NotImplementedError "You must implement the jvp function")
            hit = None
        if hit is not None:
            out = _replay(func, args, kwargs, hit[1])
        else:
            out = func(*args, **kwargs)
            if idx is not None and self.policy is not None and _replayable(func, args, kwargs) and self.policy(func, *args, **kwargs):
                self.saved[idx] = [t.detach() for t in _tensor_leaves(out)]
                self.signatures[idx] = _signature(func, args, kwargs)
        if self.discover:
            for t in _tensor_leaves(out):
                self.internal[id(t)] = t
        return out


@contextlib.contextmanager
def custom_function_op() -> Iterator[None]:
    """Around a `custom_jvp`/`custom_vjp` function's primal run without its rule, inside a
    checkpointed function: one op, whose own ops are not numbered or saved.

    A checkpointed function's ops are numbered in the run that saves the policy's outputs
    and replayed by number in the recomputation. There the custom function is differentiated:
    its `autograd.Function.apply` is one op to this mode (torch hides the ops inside it),
    whereas the saving run (no gradients) calls the function itself. Counting it as one op
    here keeps the two numberings aligned (a saved matrix product was replayed in place of
    the wrong op).
    """
    mode = getattr(_STATE, "mode", None)
    if mode is None or mode.opaque or mode not in _active_function_modes():
        yield
        return
    mode.opaque += 1
    try:
        yield
    finally:
        mode.opaque -= 1


def _active_function_modes() -> list[Any]:
    from torch.overrides import _get_current_function_mode_stack

    return list(_get_current_function_mode_stack())


def _sum_to(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Reduce a broadcast gradient back to `shape`."""
    while x.ndim > len(shape):
        x = x.sum(0)
    for d, n in enumerate(shape):
        if n == 1 and x.shape[d] != 1:
            x = x.sum(d, keepdim=True)
    return x


# The closed-form products below run in the saved product's dtype (the gradient's), and each
# gradient comes back in its operand's dtype: under `torch.autocast` the forward multiplied
# bfloat16 casts of float32 operands, and autocast's casts send the gradients back to float32.
# Without autocast every dtype is the same and the casts do nothing.


def _matmul_vjp(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ac, bc = a.to(g.dtype), b.to(g.dtype)
    return _sum_to(g @ bc.mT.conj(), a.shape).to(a.dtype), _sum_to(ac.mT.conj() @ g, b.shape).to(b.dtype)


def _linear_vjp(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g2 = g.reshape(-1, g.shape[-1])
    x2 = x.to(g.dtype).reshape(-1, x.shape[-1])
    gb = None if b is None else _sum_to(g, b.shape).to(b.dtype)
    return (g @ w.to(g.dtype).conj()).to(x.dtype), (g2.mT @ x2.conj()).to(w.dtype), gb


def _replay_kind(func: Any) -> str | None:
    if func in (torch.matmul, torch.mm, torch.bmm, torch.Tensor.matmul, torch.Tensor.__matmul__,
                torch.Tensor.mm, torch.Tensor.bmm):
        return "matmul"
    if func is torch.nn.functional.linear:
        return "linear"
    return None


def _any_fake(tree: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor  # (as tfun._rules imports it: lazily)

    return any(isinstance(t, FakeTensor) for t in _tensor_leaves(tree))


def _signature(func: Any, args: Any, kwargs: Any) -> Any:
    """A product's kind and its tensor operands' shapes and dtypes."""
    return (_replay_kind(func), tuple((tuple(t.shape), t.dtype) for t in _tensor_leaves((args, kwargs))))


def _replayable(func: Any, args: Any, kwargs: Any) -> bool:
    kind = _replay_kind(func)
    if kind == "matmul":
        return (
            not kwargs
            and len(args) == 2
            and all(isinstance(t, torch.Tensor) and t.ndim >= 2 for t in args)
        )
    if kind == "linear":
        a = list(args) + [kwargs.get(k) for k in ("input", "weight", "bias")[len(args):] if k in kwargs]
        return 2 <= len(a) <= 3 and all(isinstance(t, torch.Tensor) for t in a[:2]) and a[1].ndim == 2 and a[0].ndim >= 1
    return False


class _ReplayFunction(torch.autograd.Function):
    """A matrix product whose output was saved: returns it; backward is closed-form."""

    generate_vmap_rule = True

    @staticmethod
    def forward(kind: str, saved: torch.Tensor, *operands: Any) -> torch.Tensor:  # type: ignore[override]
        return saved.view_as(saved)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.kind = inputs[0]
        ops = inputs[2:]
        ctx.has_bias = len(ops) == 3 and ops[2] is not None
        ctx.save_for_backward(*[o for o in ops if o is not None])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:  # type: ignore[override]
        ops = ctx.saved_tensors
        if ctx.kind == "matmul":
            ga, gb = _matmul_vjp(ops[0], ops[1], g)
            return None, None, ga, gb
        gx, gw, gbias = _linear_vjp(ops[0], ops[1], ops[2] if ctx.has_bias else None, g)
        return (None, None, gx, gw) + ((gbias,) if len(ctx.needs_input_grad) == 5 else ())


def _replay(func: Any, args: Any, kwargs: Any, saved: list[torch.Tensor]) -> Any:
    kind = _replay_kind(func)
    if kind == "matmul":
        return _ReplayFunction.apply(kind, saved[0], args[0], args[1])
    a = list(args) + [kwargs[k] for k in ("input", "weight", "bias")[len(args):] if k in kwargs]
    return _ReplayFunction.apply(kind, saved[0], *a)


# --------------------------------------------------------------------------------------
# random number generator state
# --------------------------------------------------------------------------------------


class _RngState:
    """The CPU generator's state and the CUDA generators' states of the devices involved,
    taken just before the forward run, so every recomputation draws the same random numbers
    (dropout masks, ...) as the forward did (as `torch.utils.checkpoint` with
    `preserve_rng_state=True`)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        devices = {t.device.index for t in tensors if t.device.type == "cuda"}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            devices.add(torch.cuda.current_device())
        self.cuda_devices = sorted(d if d is not None else torch.cuda.current_device() for d in devices)
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]

    def set(self) -> None:
        torch.set_rng_state(self.cpu)
        for d, st in zip(self.cuda_devices, self.cuda):
            torch.cuda.set_rng_state(st, d)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the body from the saved states; the generators are left as they were."""
        with torch.random.fork_rng(devices=self.cuda_devices, enabled=True):
            self.set()
            yield


def _replaying(rng: _RngState | None) -> Any:
    return contextlib.nullcontext() if rng is None else rng.replay()


# --------------------------------------------------------------------------------------
# under tracing (tfun.jit, torch.export): torch.utils.checkpoint, which Dynamo captures
# --------------------------------------------------------------------------------------

#: The ATen matrix products a policy is asked about under tracing, and the torch function
#: each is shown to the policy as (`torch.matmul`, `@`, `F.linear` and `einsum` decompose
#: into these before torch's selective checkpointing sees an op).
_ATEN_DOTS: dict[Any, Any] = {
    torch.ops.aten.mm: torch.mm,
    torch.ops.aten.bmm: torch.bmm,
    torch.ops.aten.addmm: torch.addmm,
    torch.ops.aten.baddbmm: torch.baddbmm,
    torch.ops.aten.addbmm: torch.addbmm,
    torch.ops.aten.mv: torch.mv,
    torch.ops.aten.addmv: torch.addmv,
    torch.ops.aten.dot: torch.dot,
}


def _selective_policy(policy: Callable[..., bool], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """A `torch.utils.checkpoint` selective-checkpointing policy from a tfun policy: a
    matrix product the tfun policy selects is saved, every other op is recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    func = _ATEN_DOTS.get(getattr(op, "overloadpacket", None))
    if func is not None and policy(func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts(policy: Callable[..., bool]) -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(functools.partial(_selective_policy, policy))


def _checkpoint_body(fn: Callable[..., Any], policy_key: int) -> Callable[..., Any]:
    """How a traced `tfun.checkpoint` around control flow checkpoints each branch and loop
    body: with the enclosing checkpoint's policy, named by its key (a Dynamo constant; that
    body's own traced checkpoint reuses the key, `_hop.escape_policy_key`)."""
    return checkpoint(fn, policy=functools.partial(_hop.keyed_policy, policy_key) if policy_key else None)


@_hop.assume_constant
def _reverse_transform_traced() -> bool:
    """Trace time: whether `torch.func` reverse mode encloses the call being traced."""
    return _context.reverse_mode_active()


def _vmap_traced() -> bool:
    """Trace time: whether a `torch.func` vmap encloses the call being traced."""
    return any(kind == "Vmap" for kind, _ in _hop.traced_transforms())


def _traced_checkpoint(
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    static: dict[int, Any],
    policy: Callable[..., bool] | None,
    preserve_rng_state: bool,
) -> Any:
    """`checkpoint` in traced code: `torch.utils.checkpoint.checkpoint(use_reentrant=False)`,
    which Dynamo captures as a higher-order op (`tag_activation_checkpoint`), with the policy
    as torch's selective activation checkpointing. Tensor leaves of the non-static arguments
    are its inputs; closed-over tensors are lifted by Dynamo.

    Inside a `torch.func` reverse-mode transform that Dynamo traces (`tfun.grad` of a function
    that closes over tensors requiring grad, `tfun.vjp`, `jacrev`), torch refuses the
    saved-tensor hooks `torch.utils.checkpoint` is made of; the value and its gradient are
    then computed in one graph, with no autograd boundary for activations to cross, and `fun`
    is called as it is (same values and gradients, no rematerialization)."""
    if _reverse_transform_traced():
        return fun(*args)
    if policy is not None and not _compat.selective_checkpoint_vmaps() and _vmap_traced():
        policy = None  # (everything recomputed: the same values and gradients)
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    # torch's checkpoint op refuses control-flow ops inside it. Whether `fun` contains any is
    # learned by tracing it once in a `remat_scope`, where every tfun.lax op lowered
    # checkpoints its bodies (branches, loop bodies) with `policy`: with control flow, that
    # trace is the result; without, its ops are dead code and `fun` is traced again under
    # torch's op.
    # With a policy, each body's checkpoint applies it (JAX's remat of a loop applies the
    # policy to the body); the code between the control-flow ops is then stored.
    lowered = _hop.lowerings()
    with _hop.remat_scope(_hop.escape_policy_key(policy)):
        out = fun(*args)
    if _hop.lowerings() != lowered:
        return out

    dyn = partition(tuple(a for i, a in enumerate(args) if i not in static))

    def tfun_checkpoint_body(*tensors: torch.Tensor) -> Any:
        call = list(dyn.combine(tensors))
        for i in sorted(static):
            call.insert(i, static[i])
        out = fun(*call)
        # an input returned unchanged (a cond branch `lambda a: a`, checkpointed as a body of
        # a checkpointed function) leaves torch's checkpoint op as a copy: returned as it is,
        # Dynamo failed inside a branch ("lift_tracked_freevar_to_input should not be called on
        # root SubgraphTracer", hunt 25 finding 2)
        leaves, td = tree_flatten(out)
        if not any(isinstance(x, torch.Tensor) and any(x is t for t in tensors) for x in leaves):
            return out
        return tree_unflatten(td, [x.clone() if isinstance(x, torch.Tensor) and any(x is t for t in tensors) else x for x in leaves])

    options: dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": preserve_rng_state}
    if policy is not None:
        options["context_fn"] = functools.partial(_selective_contexts, policy)
    return torch_checkpoint(tfun_checkpoint_body, *dyn.dynamic, **options)


# --------------------------------------------------------------------------------------
# checkpoint
# --------------------------------------------------------------------------------------


class _Spec:
    fun: Callable[..., Any]
    args: Partition  # the non-static arguments: tensors are the autograd.Function's inputs
    static: dict[int, Any]
    nargs: int
    n_in: int
    externals: list[torch.Tensor]
    policy: Callable[..., bool] | None
    precomputed: tuple[list[torch.Tensor], dict[int, list[torch.Tensor]], dict[int, Any]] | None
    out: Partition  # the output: tensors are the autograd.Function's outputs
    saved_index: list[tuple[int, int, Any]]
    n_out: int
    rng: _RngState | None
    autocast: _context.AutocastState | None = None  # the forward's, for the recompute (None: as it is then)

    def call(self, tensors: Sequence[torch.Tensor]) -> Any:
        args = list(self.args.combine(tensors))
        for i, v in self.static.items():
            args.insert(i, v)
        return self.fun(*args)

    def subst(self, ext_values: Sequence[torch.Tensor]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return {id(e): (e, v) for e, v in zip(self.externals, ext_values)}


def _flatten_out(spec: _Spec, out: Any) -> list[torch.Tensor]:
    spec.out = partition(out)
    return spec.out.dynamic


class _CheckpointFunction(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(spec: _Spec, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        if spec.precomputed is not None:
            outs, saved, signatures = spec.precomputed
            spec.precomputed = None
        else:
            ins, exts = tensors[: spec.n_in], tensors[spec.n_in :]
            mode = _Mode(subst=spec.subst(exts), policy=spec.policy)
            with mode:
                out = spec.call(ins)
            outs, saved, signatures = _flatten_out(spec, out), mode.saved, mode.signatures
        spec.saved_index = [(idx, len(v), signatures[idx]) for idx, v in sorted(saved.items())]
        extra = [t for _, v in sorted(saved.items()) for t in v]
        outs = [o.view_as(o) if any(o is t for t in tensors) else o for o in outs]
        spec.n_out = len(outs)
        return tuple(outs) + tuple(extra)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        spec: _Spec = inputs[0]
        extra = output[spec.n_out :]
        if extra:
            ctx.mark_non_differentiable(*extra)
        ctx.spec = spec
        ctx.n_tensors = len(inputs) - 1
        ctx.n_extra = len(extra)
        ctx.save_for_backward(*inputs[1:], *extra)
        ctx.save_for_forward(*inputs[1:])

    @staticmethod
    def jvp(ctx: Any, _spec_tangent: Any, *tangents: Any) -> Any:  # type: ignore[override]
        # Forward mode saves nothing across a backward pass, so checkpointing has nothing to
        # save: push the tangents through the function itself.
        spec: _Spec = ctx.spec
        tensors = list(ctx.saved_tensors)
        diff = [k for k, t in enumerate(tensors) if is_inexact(t)]

        def run(*d: torch.Tensor) -> tuple[torch.Tensor, ...]:
            vals = list(tensors)
            for k, v in zip(diff, d):
                vals[k] = v
            with _Mode(subst=spec.subst(vals[spec.n_in :])), _context.autocast_restored(spec.autocast):
                out = spec.call(vals[: spec.n_in])
            return tuple(partition(out).dynamic)

        primals = tuple(tensors[k] for k in diff)
        tans = tuple(
            torch.zeros_like(tensors[k]) if tangents[k] is None else tangents[k] for k in diff
        )
        with _replaying(spec.rng):
            _, out_tangents = torch.func.jvp(run, primals, tans)
        return (*out_tangents, *([None] * ctx.n_extra))

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        spec: _Spec = ctx.spec
        saved = ctx.saved_tensors
        tensors, extra = list(saved[: ctx.n_tensors]), saved[ctx.n_tensors :]
        replay: dict[int, tuple[Any, list[torch.Tensor]]] = {}
        pos = 0
        for idx, n, sig in spec.saved_index:
            replay[idx] = (sig, list(extra[pos : pos + n]))
            pos += n
        diff = [k for k, t in enumerate(tensors) if is_inexact(t)]
        out_diff: list[int] = []

        def recompute(*d: torch.Tensor) -> list[torch.Tensor]:
            vals = list(tensors)
            for k, v in zip(diff, d):
                vals[k] = v
            mode = _Mode(subst=spec.subst(vals[spec.n_in :]), replay=replay or None)
            # under the forward's autocast state: `.backward()` usually runs after the
            # `torch.autocast` block, and the recompute must compute what the forward did
            # (the same dtypes, the same branches taken; hunt 33, F3)
            with torch.enable_grad(), mode, _context.autocast_restored(spec.autocast):
                out = spec.call(vals[: spec.n_in])
            leaves = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
            out_diff[:] = [k for k, o in enumerate(leaves) if is_inexact(o)]
            return [leaves[k] for k in out_diff]

        if not diff or all(g is None for g in grads[: spec.n_out]):
            return (None,) * (1 + ctx.n_tensors)

        def pairing(*d: torch.Tensor) -> torch.Tensor:
            # <grads, outputs>, whose gradient is the VJP (torch's convention for complex
            # values: Re(sum(conj(g) * o))). torch.func.grad differentiates it inside its own
            # level, so a checkpoint nested in `fun` runs its backward while this level is
            # live (a vjp's pullback would run it after the level is gone).
            outs = recompute(*d)
            total = torch.zeros((), dtype=outs[0].real.dtype if outs else d[0].real.dtype, device=d[0].device)
            for k, o in zip(out_diff, outs):
                gk = grads[k]
                if gk is not None:
                    total = total + ((gk.conj() * o).real.sum() if o.is_complex() else (gk * o).sum())
            return total

        with _replaying(spec.rng):
            cts = torch.func.grad(pairing, argnums=tuple(range(len(diff))))(*[tensors[k] for k in diff])
        result: list[Any] = [None] * ctx.n_tensors
        for k, c in zip(diff, cts):
            result[k] = c
        return (None, *result)


def _check_static_argnums(statics: tuple[int, ...], args: tuple[Any, ...], fun: Callable[..., Any]) -> None:
    for i in statics:
        if i >= len(args):
            raise ArgumentValueError(
                format_message(
                    f"tfun.checkpoint: static_argnums contains {i}, but the function was called with "
                    f"{len(args)} positional arguments.",
                    function=describe(fun),
                )
            )


def checkpoint(
    fun: Callable[..., Any] | None = None,
    *,
    prevent_cse: bool = True,
    policy: Callable[..., bool] | None = None,
    static_argnums: int | Sequence[int] = (),
    preserve_rng_state: bool = True,
) -> Any:
    """Rematerialize `fun`'s intermediates in backward instead of storing them, as
    `jax.checkpoint` (alias `tfun.remat`).

    Forward runs `fun` without recording a graph and keeps only its inputs, the tensors
    it closes over, and the op outputs `policy` selects; backward re-runs `fun` and
    differentiates it. Works under `.backward()`/`torch.autograd.grad` and under
    `tfun.grad`/`vmap`/`torch.func.grad`/`vjp`/`vmap` (unlike `torch.utils.checkpoint`).
    Tensors `fun` closes over (e.g. the parameters of an `nn.Module` it calls) are found
    by a `TorchFunctionMode` and receive gradients. Under a `torch.func` transform the
    discovery costs one extra forward run of `fun`. Forward mode (`jvp`, `jacfwd`,
    `hessian`) pushes tangents through `fun` itself (it has nothing to save). `fun` must
    run the same ops each time and must not mutate the tensors it closes over between
    forward and backward. Randomness inside `fun` (dropout) is reproduced: with
    `preserve_rng_state=True` every recomputation starts from the random generator states
    the forward started from, so gradients equal those of the un-checkpointed function
    under the same seed.

    Under `tfun.jit` (and `torch.compile`) it lowers to
    `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`, which Dynamo captures
    as one `tag_activation_checkpoint` op, with `policy` as torch's selective activation
    checkpointing; values and gradients are those of eager mode. torch's op refuses
    control flow inside it: where `fun` contains `tfun.lax` control flow, each branch and
    loop body is checkpointed instead, with `policy`, and the code between them is stored
    (as JAX's remat of a loop applies the policy to its body). With
    `tfun.grad` inside `tfun.jit`, torch 2.13 and later refuse torch random draws in
    `fun` (use `tfun.random`): a `JitError`. See "`tfun.checkpoint` under `tfun.jit`" in
    docs/concepts/tracing.md.

    **Arguments:**

    - `fun`: a function of pytree arguments returning a pytree (tensor leaves are
      differentiable). Used as `@checkpoint` or `checkpoint(policy=...)(fun)`.
    - `prevent_cse`: accepted for JAX compatibility; eager PyTorch performs no common
      subexpression elimination, and under `tfun.jit` torch's partitioner decides what is
      recomputed, so it has no effect.
    - `policy`: which op outputs to save rather than recompute: `None` (save nothing but
      the inputs, like `checkpoint_policies.nothing_saveable`), or one of
      `tfun.checkpoint_policies` (`everything_saveable`, `dots_saveable`,
      `dots_with_no_batch_dims_saveable`), or any callable
      `policy(func, *args, **kwargs) -> bool`. Only matrix products can be saved
      (see `checkpoint_policies`, also for what a policy is asked under `tfun.jit`);
      everything else is recomputed. Under `tfun.vmap` (eagerly, and under `tfun.jit` on
      torch 2.11) the policy is not applied: everything is recomputed, with the same
      values and gradients.
    - `static_argnums`: positions of arguments passed through untouched (not flattened,
      not differentiated): Python values, functions, configuration.
    - `preserve_rng_state`: save the CPU random generator state and the CUDA generator
      states (of the devices of `fun`'s tensor arguments, and the current CUDA device) before
      the forward run, and restore them for every recomputation (`.backward()`, `torch.func`
      and `tfun` transforms, forward mode), as `torch.utils.checkpoint` does. Pass `False`
      only if `fun` draws no random numbers, to skip saving the states.

    **Returns:** a function with `fun`'s signature and outputs.
    """
    if fun is None:
        return functools.partial(
            checkpoint,
            prevent_cse=prevent_cse,
            policy=policy,
            static_argnums=static_argnums,
            preserve_rng_state=preserve_rng_state,
        )
    if not callable(fun):
        raise ArgumentTypeError(format_message(f"tfun.checkpoint: fun must be callable, got {describe_value(fun)}."))
    if policy is not None and not callable(policy):
        raise ArgumentTypeError(
            format_message(
                f"tfun.checkpoint: policy must be None or a callable, got {describe_value(policy)}.",
                revise="Pass one of tfun.checkpoint_policies, e.g. `policy=tfun.checkpoint_policies.dots_saveable`.",
            )
        )
    statics = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in statics):
        raise ArgumentTypeError(
            format_message(f"tfun.checkpoint: static_argnums must be non-negative ints, got {static_argnums!r}.")
        )
    if not isinstance(preserve_rng_state, bool):
        raise ArgumentTypeError(
            format_message(
                f"tfun.checkpoint: preserve_rng_state must be a bool, got {describe_value(preserve_rng_state)}."
            )
        )
    if policy is checkpoint_policies.nothing_saveable:
        policy = None

    # updated=(): the wrapped function's __dict__ is not copied (Dynamo cannot read a
    # `functools.partial`'s, e.g. `tfun.checkpoint(partial(lax.scan, f))` under tfun.jit)
    @_compat.wraps(fun, updated=())
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if kwargs:
            fun_k = functools.partial(fun, **kwargs)
        else:
            fun_k = fun
        if policy is checkpoint_policies.everything_saveable:
            return fun_k(*args)
        _check_static_argnums(statics, args, fun)
        if _context.is_tracing():
            return _traced_checkpoint(fun_k, args, {i: args[i] for i in statics}, policy, preserve_rng_state)
        if _context.forward_mode_active():
            # Forward mode saves nothing for a backward pass, so there is nothing to
            # rematerialize; and the forward rule below would hide `fun`'s ops from an
            # enclosing jvp (jvp of jvp gave a zero second-order tangent).
            return fun_k(*args)
        spec = _Spec()
        spec.fun = fun_k
        spec.policy = policy
        spec.static = {i: args[i] for i in sorted(statics)}
        dyn = tuple(a for i, a in enumerate(args) if i not in spec.static)
        spec.args = partition(dyn)
        ins = spec.args.dynamic
        spec.n_in = len(ins)
        # discovery run: no graph; finds closed-over tensors (and, outside torch.func, is the forward)
        spec.rng = _RngState(ins) if preserve_rng_state else None
        plain = not _context.functorch_active()
        if not plain and _context.vmap_active():
            # Under a vmap, the policy's saved products would leave the Function as extra
            # outputs, whose absent cotangents torch's generated batching rule cannot take
            # ("flat_bdims must not be None" in a reverse mode around the vmap; hunt 31,
            # finding 2): everything is recomputed there (the same values and gradients).
            spec.policy = None
        mode = _Mode(inputs=ins, discover=True, policy=policy if plain else None)
        try:
            with torch.no_grad(), mode:
                out = spec.call(ins)
        except RuntimeError as e:
            if "does not require grad and does not have a grad_fn" not in str(e):
                raise
            # (hunt 25, finding 5b: a gradient penalty, `torch.autograd.grad(..., create_graph=True)`)
            raise ArgumentValueError(
                format_message(
                    "tfun.checkpoint: the checkpointed function differentiates with torch.autograd inside "
                    "(torch.autograd.grad or .backward() on its own values), which tfun.checkpoint cannot "
                    "run: it first runs the function without autograd, to find what it reads and to save "
                    f"what the policy names. torch said: {str(e).splitlines()[0]}",
                    function=describe(fun),
                    revise="Differentiate inside with tfun.grad or tfun.vjp (torch.func; a gradient penalty "
                    "`(tfun.grad(inner)(x) ** 2).sum()` works inside tfun.checkpoint), or checkpoint with "
                    "torch.utils.checkpoint.checkpoint(f, ..., use_reentrant=False).",
                )
            ) from e
        spec.externals = mode.externals
        spec.autocast = _context.autocast_state(t.device for t in (*ins, *spec.externals))
        outs = _flatten_out(spec, out)
        if plain:
            needs = torch.is_grad_enabled() and any(t.requires_grad for t in ins + spec.externals)
            if not needs:
                return out
            spec.precomputed = (outs, mode.saved, mode.signatures)
        else:
            spec.precomputed = None
            if spec.rng is not None:
                # the forward below runs `fun` again: it draws what the discovery run drew
                spec.rng.set()
        res = _CheckpointFunction.apply(spec, *ins, *spec.externals)
        return spec.out.combine(res[: spec.n_out])

    return checkpointed


remat = checkpoint

# Under tfun.jit, the bodies of control flow inside a checkpointed function are checkpointed
# instead of the function (see `_traced_checkpoint`): tfun.lax asks for this through `_hop`.
_hop.register_remat(_checkpoint_body)
