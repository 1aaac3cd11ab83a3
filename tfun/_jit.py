"""`tfun.jit`: JAX's `jax.jit` over `torch.compile`, with tfun's control flow lowered to HOPs.

Under `tfun.jit` every `tfun.lax` op lowers to one of PyTorch's control-flow higher-order
operators (see `tfun/lax/_hop.py`), so a loop of any length is one graph node and compile
time does not grow with the trip count.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import functools
import inspect
import itertools
import re
import threading
import traceback
import types
import warnings
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from . import _compat, _context, _cuda_graphs, _funcinfo, _jit_options, _rules
from ._compat import is_hashable
from ._errors import ArgumentTypeError, ArgumentValueError, JitError, TfunError, format_message
from ._tree import tree_flatten, tree_unflatten
from .lax import _hop

__all__ = ["jit", "JitError", "Jitted", "Lowered"]


_CACHE_SIZE = 64


def jit(
    fun: Callable[..., Any] | None = None,
    *,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    fullgraph: bool = True,
    cache_size: int = _CACHE_SIZE,
    cuda_graphs: bool | str = "auto",
    **compile_options: Any,
) -> Any:
    """Compile `fun` with `torch.compile`, JAX-style.

    Usable as `tfun.jit(f)`, `@tfun.jit` or `@tfun.jit(static_argnums=...)`, on plain
    functions, bound methods, `nn.Module`s and methods in a class body.

    **Arguments:**

    - `fun`: the function to compile. Arguments and results are pytrees of tensors.
    - `static_argnums`, `static_argnames`: positional indices / keyword names of arguments
      that are Python values rather than tensors (ints, strings, tuples, functions...).
      They must be hashable; each distinct value is compiled once and kept in an LRU cache
      of `cache_size` entries, as a compile-time constant (a static `fori_loop` bound
      stays a Python int). Objects hashed by identity are held by weak reference.
    - New argument shapes: as with `torch.compile`, the first shape is compiled
      specialized and a second distinct shape recompiles with symbolic sizes ("automatic
      dynamic"), which then serves every later shape (`dynamic=True` starts symbolic).
      With `dynamic=False` each shape is compiled, up to `max(cache_size, torch's
      recompile_limit)` compilations; past that, a `JitError` says what to change.
    - `donate_argnums`: accepted for JAX compatibility. PyTorch has no buffer donation at
      the `torch.compile` boundary, so it is a no-op hint (validated, otherwise ignored).
    - `fullgraph`: `True` (the default) makes anything Dynamo cannot capture as one graph
      an error (`tfun.errors.JitError` naming the user's line, with Dynamo's exception as
      `__cause__`) instead of a silent graph break. A tfun rule broken in traced code
      raises the same error class and message as without `tfun.jit`. When Dynamo refuses
      a control-flow body for a side effect, `fun` is run once eagerly to name it (tfun's
      `SideEffectError`); that run only reports the error, its result is never returned.
    - Nested: a `tfun.jit` function called inside another (or as a control-flow body
      under it) is inlined, as `jax.jit` inlines.
    - `cuda_graphs` (`"auto"` by default): on CUDA, from a call's second run with the same
      argument signature (shapes, dtypes, static values...), replay the call from a CUDA
      graph: one launch for the whole call instead of the host launching every kernel of
      every loop step (an H100, a 1024-step RNN forward: 42.9 -> 3.7 ms; an H200:
      23.6 -> 3.5 ms, `jax.jit` 6.4 ms).
      `"auto"` does so where it is safe: every tensor argument and result on one CUDA
      device, no result requiring grad (differentiate inside:
      `tfun.jit(tfun.value_and_grad(loss))`), one Dynamo graph that reads only its
      arguments (no closed-over tensor or module parameter) and writes none, no host
      synchronization (a `while_loop` with its predicate on the GPU synchronizes every
      step), at most 8 signatures per function (each graph keeps its own memory), and tensor
      arguments of at most 256 MiB in all (the graph keeps a copy of them);
      otherwise the call runs as compiled and the reason is logged on the `tfun.jit`
      logger (`.cuda_graph_reasons()` lists them). A replayed call copies its tensor
      arguments in and its results out. `True` makes such a reason an error, except that
      closed-over tensors are accepted (update them in place only: the graph reads their
      memory), and records up to `cache_size` signatures. `False` never records. Calls on
      the CPU are never recorded; nor with torch's own CUDA graphs
      (`mode="reduce-overhead"`). See `tfun._cuda_graphs`.
    - `**compile_options`: passed to `torch.compile` (`mode`, `dynamic`, `backend`,
      `options`). On the CPU, `options={"cpp_wrapper": True}` runs a compiled loop's
      steps from C++ (about 4x less overhead per step, a few seconds more compilation);
      it is not the default because torch's C++ wrapper fails on some loop programs (2.13:
      a reverse scan, a while_loop's gradient; 2.11: any scan; docs/performance.md).
      With Inductor in its default mode, tfun.jit adds its defaults for loops
      (`tfun._jit_options`): small CPU matrix products (at most 2^18 multiply-adds, static
      sizes) are compiled as fused loops rather than extern GEMM calls, the copying views
      of a differentiated loop body (`select_copy`, ...) as fused views rather than ATen
      calls, a CPU scan, map or while_loop as a loop that updates its
      state in place (nothing allocated and no counter read back per step, the condition
      computed inside the step), and CPU kernels under 16,384
      elements run on one thread. An Inductor option you set in `options` wins
      (`{"post_grad_custom_pre_pass": None}` turns the first two rewrites off,
      `{"post_grad_custom_post_pass": None}` the in-place loops, `{"cpp.min_chunk_size": 512}`
      restores torch's threading).

    **Returns:** a callable with the signature of `fun`, with `.lower(*args)` for
    introspection (`Lowered`: `.graph`, `.graphs`, `.as_text()`, `.graph_breaks`).
    """
    if fun is None:
        return functools.partial(
            jit,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
            fullgraph=fullgraph,
            cache_size=cache_size,
            cuda_graphs=cuda_graphs,
            **compile_options,
        )
    if _context.is_tracing() and callable(fun):
        # `tfun.jit(f)` called inside traced code (a loop body under tfun.jit, as JAX's
        # `jax.jit(f)(x)` in a `while_loop` body): a call of it would be inlined into the outer
        # graph (see `Jitted.__call__`), so `f` itself is that call; Dynamo cannot build a
        # `Jitted` (its lock and caches) while tracing.
        return fun
    if isinstance(fun, Jitted) and not (fun._static_nums or fun._static_names or fun._donate_argnums):
        # `jit(jit(f))` is `jit(f)`, as in JAX: a call of the inner one would be inlined into
        # the outer graph anyway (see `Jitted.__call__`). Compiling `f` itself also spares
        # Dynamo the inner `Jitted` object, whose attributes Dynamo 2.11 cannot always read
        # ("could not find name in object's mro" when `f` is a custom_jvp function).
        fun = fun._fun
    return Jitted(fun, static_argnums, static_argnames, donate_argnums, fullgraph, cache_size, compile_options, cuda_graphs)


def _as_tuple(v: Any, kind: type, what: str, fn_text: str) -> tuple[Any, ...]:
    if isinstance(v, kind) and not isinstance(v, bool):
        return (v,)
    try:
        out = tuple(v)  # type: ignore[arg-type]
    except TypeError:
        raise ArgumentTypeError(
            f"tfun.jit: {what} must be {'an int' if kind is int else 'a str'} or a sequence of them, but got "
            f"{v!r} (jitting `{fn_text}`)."
        ) from None
    for x in out:
        if not isinstance(x, kind) or isinstance(x, bool):
            raise ArgumentTypeError(
                f"tfun.jit: {what} must contain only {'ints' if kind is int else 'strs'}, but got {x!r} "
                f"(jitting `{fn_text}`)."
            )
    return out


class Lowered:
    """What Dynamo captured for one call: the FX graph(s) and the number of graph breaks."""

    def __init__(self, graphs: list[torch.fx.GraphModule], fn_text: str) -> None:
        self.graph_modules = graphs
        self.graphs = [g.graph for g in graphs]
        self.graph_breaks = max(len(graphs) - 1, 0)
        self._fn_text = fn_text

    @property
    def graph(self) -> torch.fx.Graph:
        """The (first) captured FX graph."""
        if not self.graphs:
            raise JitError(f"tfun.jit: no graph was captured for `{self._fn_text}` (it ran no tensor ops).")
        return self.graphs[0]

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return self.graph_modules[0]

    def as_text(self) -> str:
        """The Python code of every captured graph (subgraphs of HOPs included)."""
        parts = []
        for i, gm in enumerate(self.graph_modules):
            parts.append(f"# graph {i}\n" + gm.print_readable(print_output=False))
        return "\n".join(parts)

    def count(self, target_name: str) -> int:
        """How many live nodes of the outer graphs call a target whose name contains
        `target_name`. A node is live when its result reaches the graph's outputs or it has
        a side effect; dead nodes (such as those of `tfun.grad`'s trace-time probe for
        closed-over tensors that require grad) are dropped by the compiler before anything
        runs, so they are not counted."""
        n = 0
        for g in self.graphs:
            live = _live_nodes(g)
            for node in g.nodes:
                if node in live and node.op == "call_function" and target_name in _target_text(node.target):
                    n += 1
        return n

    def __repr__(self) -> str:
        return f"Lowered({len(self.graphs)} graph(s), {self.graph_breaks} graph break(s))"


def _live_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes whose results reach the output, or that have side effects, and their inputs."""
    stack = [n for n in graph.nodes if n.op == "output" or (n.op != "placeholder" and n.is_impure())]
    live: set[torch.fx.Node] = set()
    while stack:
        node = stack.pop()
        if node not in live:
            live.add(node)
            stack.extend(node.all_input_nodes)
    return live


def _target_text(target: Any) -> str:
    """`torch.ops.higher_order.scan` for a HOP, `str(target)` for anything else."""
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"torch.ops.higher_order.{target.name()}"
    return str(target)


def _copy_function(fn: types.FunctionType, name: str) -> types.FunctionType:
    """A copy of `fn` with its own code object, so Dynamo keeps a separate cache for it."""
    code = fn.__code__.replace(co_name=name)
    new = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = name
    return new


class Jitted:
    """The callable returned by `tfun.jit`."""

    def __init__(
        self,
        fun: Callable[..., Any],
        static_argnums: Any,
        static_argnames: Any,
        donate_argnums: Any,
        fullgraph: bool,
        cache_size: int,
        compile_options: dict[str, Any],
        cuda_graphs: bool | str = "auto",
    ) -> None:
        if not callable(fun):
            raise ArgumentTypeError(f"tfun.jit: expected a function, but got {type(fun).__qualname__}: {fun!r}.")
        self._fun = fun
        self._fn_text = _funcinfo.describe(fun)
        self._fullgraph = bool(fullgraph)
        self._options = dict(compile_options)
        if "fullgraph" in self._options:  # pragma: no cover - consumed above
            self._options.pop("fullgraph")
        if not isinstance(cache_size, int) or cache_size < 1:
            raise ArgumentValueError(f"tfun.jit: cache_size must be a positive int, but got {cache_size!r}.")
        self._cache_size = cache_size
        if not (cuda_graphs is True or cuda_graphs is False or cuda_graphs == "auto"):
            raise ArgumentValueError(f'tfun.jit: cuda_graphs must be False, "auto" or True, but got {cuda_graphs!r}.')
        self._cuda_graphs = cuda_graphs
        self._graphs: _cuda_graphs.GraphCache | None = None
        if cuda_graphs is not False:
            if _cuda_graphs.applies(self._options):
                self._graphs = _cuda_graphs.GraphCache(cuda_graphs is True, self._fn_text, cache_size)
            elif cuda_graphs is True:
                raise ArgumentValueError(
                    format_message(
                        f"tfun.jit: cuda_graphs=True, but torch.compile records its own CUDA graphs with "
                        f"{ {k: v for k, v in self._options.items() if k in ('mode', 'backend', 'options')} } "
                        f"(compiling `{self._fn_text}`).",
                        revise="Pass either cuda_graphs=True or torch's mode=\"reduce-overhead\", not both.",
                    )
                )
        static_argnums = _as_tuple(static_argnums, int, "static_argnums", self._fn_text)
        static_argnames = _as_tuple(static_argnames, str, "static_argnames", self._fn_text)
        self._donate_argnums = _as_tuple(donate_argnums, int, "donate_argnums", self._fn_text)
        try:
            self._sig: inspect.Signature | None = inspect.signature(fun)
        except (TypeError, ValueError):
            self._sig = None
        params = list(self._sig.parameters.values()) if self._sig is not None else []
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        variadic = any(p.kind is p.VAR_POSITIONAL for p in params)
        n_pos = len(positional)
        nums = []
        for i in static_argnums:
            j = i + n_pos if i < 0 else i
            if self._sig is not None and not variadic and not (0 <= j < n_pos):
                raise ArgumentValueError(
                    format_message(
                        f"tfun.jit: static_argnums contains {i}, but `{self._fn_text}` takes {n_pos} positional "
                        "argument(s).",
                        revise=f"Use indices in range({n_pos}) (or negative ones from the end).",
                    )
                )
            if j < 0:
                raise ArgumentValueError(f"tfun.jit: static_argnums contains {i}, which is out of range.")
            nums.append(j)
        names = set(static_argnames)
        # JAX: a static positional argument is also static when passed by keyword, and vice versa.
        for j in list(nums):
            if j < n_pos:
                names.add(positional[j].name)
        for name in list(names):
            for j, p in enumerate(positional):
                if p.name == name and j not in nums:
                    nums.append(j)
        if self._sig is not None and not any(p.kind is p.VAR_KEYWORD for p in params):
            known = {p.name for p in params}
            for name in static_argnames:
                if name not in known:
                    raise ArgumentValueError(
                        format_message(
                            f"tfun.jit: static_argnames contains {name!r}, which is not a parameter of "
                            f"`{self._fn_text}`.",
                            revise=f"Use one of {sorted(known)}.",
                        )
                    )
        self._pos_names = [p.name for p in positional]
        self._static_nums = tuple(sorted(set(nums)))
        self._static_names = frozenset(names)
        self._cache: collections.OrderedDict[Hashable, Callable[..., Any]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._plain: Callable[..., Any] | None = None
        functools.update_wrapper(self, _funcinfo.unwrap_callable(fun) if not isinstance(fun, torch.nn.Module) else fun.forward, updated=())

    @property
    def __tfun_target__(self) -> Callable[..., Any]:
        """The function the side-effect rules inspect when this is a control-flow body: the
        compiled-code cache that a call fills is not a side effect."""
        return self._fun

    # -- descriptors: `@tfun.jit` on a method in a class body -------------------------------
    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        bound = instance.__dict__.get(f"__tfun_jit_{id(self)}") if hasattr(instance, "__dict__") else None
        if bound is None:
            bound = Jitted(
                types.MethodType(self._fun, instance),
                tuple(i - 1 for i in self._static_nums if i >= 1),
                tuple(self._static_names),
                tuple(i - 1 for i in self._donate_argnums if i >= 1),
                self._fullgraph,
                self._cache_size,
                self._options,
                self._cuda_graphs,
            )
            try:
                object.__setattr__(instance, f"__tfun_jit_{id(self)}", bound)
            except (AttributeError, TypeError):
                pass
        return bound

    # -- calling ----------------------------------------------------------------------------
    def _compile(self, run: Callable[..., Any], name: str) -> Callable[..., Any]:
        if isinstance(run, types.FunctionType):
            run = _copy_function(run, name)
        try:
            options = _jit_options.compile_options(self._options)
            if _compat.compile_takes_recompile_limit and "recompile_limit" not in options:
                options = {**options, "recompile_limit": _recompile_limit_for(self._cache_size)}
            return torch.compile(run, fullgraph=self._fullgraph, **options)
        except Exception as e:
            if type(e).__name__ != "InvalidBackend":  # torch._dynamo.exc.InvalidBackend
                raise
            from torch import _dynamo

            raise ArgumentValueError(
                format_message(
                    f"tfun.jit: backend={self._options.get('backend')!r} is not a torch.compile backend "
                    f"(compiling `{self._fn_text}`).",
                    revise="Pass one of " + ", ".join(repr(b) for b in _dynamo.list_backends(exclude_tags=())) + ", or a "
                    "backend callable `(gm, example_inputs) -> callable`.",
                )
            ) from e

    def _check_static_traced(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The argument checks of `_static_key`, in code that Dynamo traces (a nested call)."""
        for j in self._static_nums:
            if j < len(args):
                _check_static(args[j], f"argument {j}", self._fn_text)
        for name in sorted(self._static_names):
            if name in kwargs:
                _check_static(kwargs[name], f"argument {name!r}", self._fn_text)

    def _static_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        key = []
        # keyed by parameter name where there is one, so f(x, 3) and f(x, n=3) share an entry
        for j in self._static_nums:
            if j < len(args):
                name = self._pos_names[j] if j < len(self._pos_names) else j
                key.append((name, _hashable_static(args[j], f"argument {j}", self._fn_text)))
        for name in sorted(self._static_names):
            if name in kwargs:
                key.append((name, _hashable_static(kwargs[name], f"argument {name!r}", self._fn_text)))
        key.sort(key=lambda kv: str(kv[0]))
        return tuple(key)

    def _runner(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        if not self._static_nums and not self._static_names:
            if self._plain is None:
                fun = self._fun

                def tfun_jit_call(*a: Any, **k: Any) -> Any:
                    _trace_settings()
                    return _hop.jit_output(fun(*a, **k))

                # A code name of its own per tfun.jit function: Dynamo keeps its "automatic
                # dynamic" state (which sizes it has seen change, and so compiles symbolic) per
                # `pgo.CodeId`, that is (file, line, name) and, from torch 2.13, a hash of the
                # closure's *code objects*. That tells `tfun.jit(f)` from `tfun.jit(g)` only when
                # f and g are plain functions of different code: two `tfun.grad(...)` or
                # `tfun.checkpoint(...)` results, two modules, or torch 2.11 (no closure hash)
                # shared one state, so the shapes one function was called with made another's
                # first compile symbolic (a slower graph, a symbolic size that cannot reach an
                # escape hatch, and torch 2.12's Inductor failing on a checkpointed dropout).
                name = f"tfun_jit_call{next(_SPECIALIZATIONS)}"
                self._plain = self._compile(tfun_jit_call, name)
            return self._plain, args, kwargs
        key = self._static_key(args, kwargs)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
        static_pos = {j: args[j] for j in self._static_nums if j < len(args)}
        static_kw = {k: v for k, v in kwargs.items() if k in self._static_names}
        dyn_args = tuple(a for j, a in enumerate(args) if j not in static_pos)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self._static_names}
        if compiled is None:
            # Each static value gets a code object of its own *name*: Dynamo keeps its
            # "automatic dynamic" state per (file, line, name), and once it has seen two
            # values of an integer read from a closure it makes that integer symbolic, so a
            # static `fori_loop` bound would become a symbol (torch 2.13 inductor: `KeyError:
            # s76`). With one name per value, a static argument stays a compile-time
            # constant, as in `jax.jit`.
            name = f"tfun_jit_call_static{next(_SPECIALIZATIONS)}"
            compiled = self._compile(_bind_static(self._fun, static_pos, static_kw), name)
            with self._lock:
                self._cache[key] = compiled
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return compiled, dyn_args, dyn_kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _context.is_tracing():
            # inside another tfun.jit (or torch.export): inlined into the outer graph, as
            # jax.jit inlines a nested jit
            if self._static_nums or self._static_names:
                self._check_static_traced(args, kwargs)  # same argument checks as the compiled path
            return self._fun(*args, **kwargs)
        if _context.in_functorch_transform() or _context.in_op_recording_mode() or _compat.forward_ad_level_active():
            # torch.func.grad(tfun.jit(f)): Dynamo cannot be entered from inside a torch.func
            # transform (pytorch#128711), so f runs eagerly there; values and gradients are
            # those of f. Put the transform inside instead: tfun.jit(tfun.grad(f)). Likewise
            # inside an eager tfun.checkpoint, whose op-numbering mode must see f's ops, and
            # under an open `torch.autograd.forward_ad` dual level: compiled, torch's loop ops
            # dropped the tangents of dual tensors without an error (`unpack_dual(y).tangent`
            # None, hunt 27), where f itself carries them.
            if self._static_nums or self._static_names:
                self._static_key(args, kwargs)  # same argument checks as the compiled path
            return self._fun(*args, **kwargs)
        compiled, dyn_args, dyn_kwargs = self._runner(args, kwargs)
        dyn_args, dyn_kwargs, non_leaf = _prepared_arguments(dyn_args, dyn_kwargs)
        # Dynamo reads `.grad` of each input tensor, and torch warns for a non-leaf one (the
        # output of an earlier op that requires grad: `tfun.jit(f)(x * 2)`), which every call
        # then failed under `-W error` or pytest's filterwarnings = ["error"]: a note about
        # torch's own access, not about the caller's code (ignored only for such calls)
        with warnings.catch_warnings() if non_leaf else contextlib.nullcontext():
            if non_leaf:
                warnings.filterwarnings("ignore", message=_NON_LEAF_GRAD_WARNING)
            if self._graphs is not None and _cuda_graphs.available():
                static_key = self._static_key(args, kwargs) if (self._static_nums or self._static_names) else ()
                return self._graphs.call(
                    static_key,
                    dyn_args,
                    dyn_kwargs,
                    lambda *a, **k: self._run_compiled(compiled, a, k, args, kwargs),
                    lambda: self.lower(*args, **kwargs).graph_modules,
                    _cuda_graphs.GuardProbe(compiled, dyn_args, dyn_kwargs),
                )
            return self._run_compiled(compiled, dyn_args, dyn_kwargs, args, kwargs)

    def _run_compiled(
        self,
        compiled: Callable[..., Any],
        dyn_args: tuple[Any, ...],
        dyn_kwargs: dict[str, Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        fwd_level = _compat.forward_ad_level()
        try:
            with _SettingsScope():
                if _compat.compile_takes_recompile_limit:
                    out = compiled(*dyn_args, **dyn_kwargs)
                else:
                    with _recompile_limit(self._cache_size):
                        out = compiled(*dyn_args, **dyn_kwargs)
            if torch.is_grad_enabled():
                _refuse_double_backward(out, self._fn_text)
            return out
        except Exception as caught:  # noqa: BLE001 - re-raised below
            _compat.close_forward_ad_levels(fwd_level)  # (a trace stopped inside a jvp leaves its level open)
            e = _compat.compile_error(caught)  # torch can hide it behind a functorch assert
            if e is not caught and not isinstance(e, TfunError) and not _is_dynamo_error(e):
                # a plain exception that ended the trace (inside a Dynamo internal), which the
                # assert hid: reported as a compile failure naming it
                raise JitError(
                    format_message(
                        f"tfun.jit: could not compile `{self._fn_text}`: {type(e).__name__}: {e}",
                        revise="Call the function (or the part of it that fails) outside tfun.jit.",
                    )
                ) from e
            err = translate_error(
                e,
                self._fn_text,
                self._cache_size,
                backend=self._options.get("backend"),
                scalars=lambda kind: self._scalar_arguments(args, kwargs, kind),
            )
            if err is e:
                raise e
            if _is_side_effect_error(e):
                weak = _weak_init_in_a_body(e)
                err = _diagnose_eagerly(self._fun, args, kwargs, err) if weak is None else weak
            raise err from getattr(err, "dynamo_error", e)

    def _scalar_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any], kind: type) -> list[str]:
        """The arguments of this call that are Python scalars of type `kind` (`float`, `int`;
        never `bool`) and not static, named as the function's signature names them: for a
        message about such an argument. Only top-level arguments are looked at."""
        names = list(self._sig.parameters) if self._sig is not None else []
        found = []
        for j, a in enumerate(args):
            if type(a) is kind and j not in self._static_nums:
                name = names[j] if j < len(names) and self._sig.parameters[names[j]].kind in _POSITIONAL else None
                found.append(f"`{name}` = {a!r} (argument {j})" if name else f"argument {j} = {a!r}")
        for k, a in kwargs.items():
            if type(a) is kind and k not in self._static_names:
                found.append(f"`{k}` = {a!r}")
        return found

    def lower(self, *args: Any, **kwargs: Any) -> Lowered:
        """Trace `fun` on these arguments and return the captured graph(s), without running
        a compiled kernel (Dynamo runs the graphs once, eagerly)."""
        graphs: list[torch.fx.GraphModule] = []

        def recorder(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
            graphs.append(gm)
            return gm.forward

        key_args = self._static_key(args, kwargs)  # validates static args
        del key_args
        static_pos = {j: args[j] for j in self._static_nums if j < len(args)}
        static_kw = {k: v for k, v in kwargs.items() if k in self._static_names}
        dyn_args = tuple(a for j, a in enumerate(args) if j not in static_pos)
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self._static_names}
        run = _bind_static(self._fun, static_pos, static_kw)
        if isinstance(run, types.FunctionType):
            run = _copy_function(run, "tfun_jit_lower")
        compiled = torch.compile(run, backend=recorder, fullgraph=False, dynamic=self._options.get("dynamic"))
        try:
            with _SettingsScope():
                compiled(*dyn_args, **dyn_kwargs)
        except Exception as e:  # noqa: BLE001
            err = translate_error(e, self._fn_text)
            if err is e:
                raise
            raise err from getattr(err, "dynamo_error", e)
        return Lowered(graphs, self._fn_text)

    def clear_cache(self) -> None:
        """Forget every compiled specialization (and every recorded CUDA graph)."""
        with self._lock:
            self._cache.clear()
            self._plain = None
        if self._graphs is not None:
            with self._graphs.lock:
                self._graphs.entries.clear()

    def cuda_graph_reasons(self) -> list[tuple[str, str]]:
        """For each argument signature a CUDA call was made with: whether it is replayed from a
        CUDA graph, or why not (`cuda_graphs=`)."""
        return [] if self._graphs is None else self._graphs.reasons()

    def __repr__(self) -> str:
        return f"tfun.jit({self._fn_text})"


def _bind_static(fun: Callable[..., Any], static_pos: dict[int, Any], static_kw: dict[str, Any]) -> Callable[..., Any]:
    """`fun` with its static arguments bound: a function of the other arguments.

    Static Python numbers are read from the function's own *globals*, everything else
    from its closure. Dynamo specializes a number read from a global (a guard on its value),
    but may make one read from a closure symbolic: with `dynamic=True` from the first
    compilation, otherwise once it has seen two values of it under one code name (see
    `Jitted._runner`). A static `fori_loop` bound would then be a symbol (torch 2.13
    inductor: `KeyError: s76`). A static argument is a compile-time constant, as in
    `jax.jit`. (Objects hashed by identity stay in the closure, so that an evicted one is
    not kept alive by Dynamo's reference to the globals of the code it compiled.)
    """
    n_static = len(static_pos)

    # A static numpy scalar is passed as the Python scalar it holds: Dynamo traces a numpy value
    # (from a closure or a global too) as an array over a tensor, so it would not be static.
    static_pos = {j: _rules.from_numpy(v) for j, v in static_pos.items()}
    static_kw = {k: _rules.from_numpy(v) for k, v in static_kw.items()}
    numbers = (int, float, bool)
    scalar_pos = {j: v for j, v in static_pos.items() if type(v) in numbers}
    other_pos = {j: v for j, v in static_pos.items() if j not in scalar_pos}
    scalar_kw = {k: v for k, v in static_kw.items() if type(v) in numbers}
    other_kw = {k: v for k, v in static_kw.items() if k not in scalar_kw}

    def tfun_jit_call(*dyn: Any, **kw: Any) -> Any:
        _tfun_trace_settings()  # type: ignore[name-defined]  # noqa: F821
        args = []
        it = iter(dyn)
        total = len(dyn) + n_static
        for j in range(total):
            if j in other_pos:
                args.append(other_pos[j])
            elif j in _tfun_static_scalar_pos:  # type: ignore[name-defined]  # noqa: F821
                args.append(_tfun_static_scalar_pos[j])  # type: ignore[name-defined]  # noqa: F821
            else:
                args.append(next(it))
        out = fun(*args, **other_kw, **_tfun_static_scalar_kw, **kw)  # type: ignore[name-defined]  # noqa: F821
        return _tfun_jit_output(out)  # type: ignore[name-defined]  # noqa: F821

    g = {
        "__builtins__": builtins,
        "_tfun_static_scalar_pos": scalar_pos,
        "_tfun_static_scalar_kw": scalar_kw,
        "_tfun_jit_output": _hop.jit_output,
        "_tfun_trace_settings": _trace_settings,
    }
    return types.FunctionType(tfun_jit_call.__code__, g, "tfun_jit_call", None, tfun_jit_call.__closure__)


#: Numbers the code objects of static specializations (see `Jitted._compile`).
_SPECIALIZATIONS = itertools.count()

# torch's module that scripts its classes at import, imported now with its deprecation warning
# ignored: a traced gradient of a loop imports it while compiling, which failed under `-W error`
_compat.import_torch_scripted_modules()


class _WeakKey:
    """Hash/equality of an identity-hashed static object, without keeping it alive."""

    __slots__ = ("ref", "h")

    def __init__(self, obj: Any) -> None:
        self.ref = weakref.ref(obj)
        self.h = id(obj)

    def __hash__(self) -> int:
        return self.h

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _WeakKey) and self.ref() is not None and self.ref() is other.ref()


def _check_static(value: Any, what: str, fn_text: str) -> None:
    """Raise the error of a static argument that is a tensor or is not hashable."""
    if isinstance(value, torch.Tensor):
        raise ArgumentTypeError(
            format_message(
                f"tfun.jit: {what} of `{fn_text}` is static, but it is a tensor.",
                revise="Pass tensors as ordinary (traced) arguments; mark only Python values "
                "(ints, strings, tuples, functions) static.",
            )
        )
    if not is_hashable(value):
        raise ArgumentTypeError(
            format_message(
                f"tfun.jit: {what} of `{fn_text}` is static, so it must be hashable, but it is a "
                f"{type(value).__qualname__}.",
                revise="Pass a hashable value (e.g. a tuple instead of a list), or do not mark it static.",
            )
        )


def _hashable_static(value: Any, what: str, fn_text: str) -> Any:
    _check_static(value, what, fn_text)
    if type(value).__hash__ is object.__hash__:
        try:
            return _WeakKey(value)
        except TypeError:
            return value
    return (type(value), value)


# ----------------------------------------------------------------------------------------
# Dynamo errors -> tfun errors
# ----------------------------------------------------------------------------------------

import os as _os

def _internal_prefixes() -> tuple[str, ...]:
    import sysconfig

    paths = sysconfig.get_paths()
    out = [
        _os.path.dirname(torch.__file__) + _os.sep,
        _os.path.dirname(_os.path.abspath(__file__)) + _os.sep,
        _os.sep + "optree" + _os.sep,
    ]
    for key in ("stdlib", "platstdlib"):  # warnings.py, contextlib.py, ...: never the user's line
        if paths.get(key):
            out.append(_os.path.abspath(paths[key]) + _os.sep)
    return tuple(out)


_INTERNAL = _internal_prefixes()


def _innermost_user_frame(stack: Sequence[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost frame of `stack` in the user's code (not torch's, tfun's or the stdlib's)."""
    for fr in reversed(list(stack)):
        if fr.filename.startswith("<frozen"):
            continue
        if not any(s in _os.path.abspath(fr.filename) for s in _INTERNAL):
            return fr
    return None


def _user_frame(e: BaseException) -> str | None:
    seen = set()
    c: BaseException | None = e
    while c is not None and id(c) not in seen:
        seen.add(id(c))
        fr = _innermost_user_frame(getattr(c, "real_stack", None) or ())
        if fr is not None:
            return f"{fr.filename}:{fr.lineno}" + (f" ({fr.line.strip()})" if fr.line else "")
        c = c.__cause__ or c.__context__
    return None


def _backend_raised(e: BaseException) -> tuple[BaseException, list[traceback.FrameSummary]]:
    """The exception a compiler backend raised, for a `BackendCompilerFailed`, and its frames."""
    inner = getattr(e, "inner_exception", None) or e.__cause__ or e
    return inner, traceback.extract_tb(inner.__traceback__)


def _worker_details(lines: list[str], last: str) -> str:
    """What follows a worker's exception line that ends in a colon: Triton's `CompilationError`
    ("at 61:50:", then up to 12 lines of the kernel's source, a caret under the failing
    column, then the reason): the failing source line and the reason. Without them a user (and
    a GPU session reading check_cuda's table) sees only a position in generated code."""
    if not last.endswith(":"):
        return ""
    rest = lines[len(lines) - lines[::-1].index(last) :]
    caret = next((i for i, ln in enumerate(rest) if set(ln) == {"^"}), None)
    picked = ([rest[caret - 1]] if caret else []) + rest[(caret + 1 if caret is not None else 0) :][:3]
    return "".join(f" | {ln[:300]}" for ln in picked)


def _backend_failure(e: BaseException) -> str:
    """What a compiler backend raised and where (its innermost frame), for a `BackendCompilerFailed`."""
    inner, frames = _backend_raised(e)
    lines = [ln.strip() for ln in str(inner).splitlines() if ln.strip()]
    text = f"{type(inner).__name__}: {lines[0]}" if lines else type(inner).__name__
    if frames:
        text += f" (raised in `{frames[-1].name}`, {_os.path.basename(frames[-1].filename)}:{frames[-1].lineno})"
    # An error re-raised from a compile worker (Inductor's `SubprocException`: "An exception
    # occurred in a subprocess:" then the worker's traceback) says what failed on its last line;
    # on CUDA (H100, torch 2.11) nn.MinGRU and nn.Mamba were refused with only the first line.
    if len(lines) > 1 and any(ln.startswith("Traceback (most recent call last)") for ln in lines):
        last = next((ln for ln in reversed(lines) if _EXCEPTION_LINE.match(ln)), None)
        if last is not None and last != lines[0]:
            text += f"; the worker raised {last[:300]}" + _worker_details(lines, last)
    elif len(lines) > 1 and lines[0].endswith(":"):
        # a headline whose details follow ("Expected init and carry to have same metadata but
        # found:" then one line per difference): the details are the message
        details = []
        for ln in lines[1:4]:
            if ln.startswith(("While executing", "Original traceback")):
                break
            details.append(ln[:300])
        if details:
            text += ": " + "; ".join(details)
    return f"the compiler backend failed: {text}"


def _raised_warning(e: BaseException) -> Warning | None:
    """The `Warning` raised as an exception somewhere in `e`'s chain (a backend's exception,
    its causes and contexts, Dynamo's wrapped errors), or None."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        c = todo.pop()
        if c is None or id(c) in seen:
            continue
        seen.add(id(c))
        if isinstance(c, Warning):
            return c
        todo += [getattr(c, "inner_exception", None), c.__cause__, c.__context__]
    return None


def _warning_pattern(w: Warning) -> str:
    """A `filterwarnings` message pattern for `w` (matched at the start of the message), to be
    shown as a raw string: its first line up to the first quote, at most 60 characters, with
    the characters a regex reads specially escaped. (It stopped at the first such character:
    torch's "`torch.jit.script_method` is deprecated" gave the pattern "`torch".)"""
    first = str(w).strip().splitlines()[0] if str(w).strip() else ""
    text = re.match(r"[^'\"]{0,60}", first).group(0)  # type: ignore[union-attr]
    return re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text)


def _failed_tracing_control_flow(e: BaseException) -> bool:
    """Whether a backend failure was raised while torch traced a control-flow op's subgraphs
    for autograd and functionalization (AOTAutograd, which backend="aot_eager" runs too), not
    while Inductor compiled the traced graph."""
    frames = _backend_raised(e)[1]
    return bool(frames) and "_higher_order_ops" in frames[-1].filename.replace("\\", "/").split("/")


# what a transform applied around a jitted function does to it (said in two messages)
_UNCOMPILED_OUTSIDE = (
    "the jitted function then runs uncompiled inside the transform, since Dynamo cannot be entered inside "
    "one; compiled per-example gradients are `tfun.jit(tfun.vmap(tfun.grad(loss)))`, with that vmap directly "
    "around the gradient and inside no other transform"
)

# the last line of a Python traceback: "ValueError: ...", "triton.compiler.errors.CompilationError: ..."
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b[^:]*:")


def _headline(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    skip = re.compile(r"^(This higher order operator doesn't work|Got graph break)")
    lines = [ln for ln in lines if not skip.match(ln)]
    body = []
    for ln in lines:
        if ln.startswith(("from user code", "Set TORCHDYNAMO_VERBOSE", "  Developer debug", " For more details")):
            break
        body.append(ln.strip())
    return " ".join(body[:3]) if body else type(e).__name__


# What `_trace_settings` changed in this thread (`prior`: [(name, value before)]) and how deep
# the `Jitted.__call__`s (and `.lower`s) of this thread are nested (`depth`).
_SETTINGS = threading.local()


def _trace_settings() -> bool:
    """Dynamo's settings for tracing a jitted function, applied by Dynamo itself.

    `trace_autograd_ops` (torch >= 2.12; skipped where it does not exist) lets Dynamo trace
    `torch.autograd.grad` (how `tfun.grad` differentiates when traced), so that
    `tfun.jit(tfun.grad(loss))` compiles to one graph. It matters only while Dynamo traces,
    so it is set from inside the trace: each `tfun_jit_call` starts with a call of this
    function, which Dynamo runs as plain Python (it is marked constant) whenever it traces
    the function, and which compiled code never runs. `Jitted.__call__` puts the settings
    back when its outermost call returns (`_SettingsScope`). Patching Dynamo's
    config around every call instead cost 30 us a call, more than the rest of tfun.jit's
    and torch.compile's overhead together (torch 2.13, CPU).
    """
    import torch._dynamo.config as dynamo_config

    if getattr(dynamo_config, "trace_autograd_ops", True) is False:
        _SETTINGS.__dict__.setdefault("prior", []).append(("trace_autograd_ops", False))
        dynamo_config.trace_autograd_ops = True
    return True


_trace_settings = _hop.assume_constant(_trace_settings)


class _SettingsScope:
    """Around a call of a jitted function (or `lower`): when the outermost one in this thread
    ends, the settings `_trace_settings` applied while Dynamo traced are put back."""

    __slots__ = ("depth",)

    def __enter__(self) -> None:
        self.depth = getattr(_SETTINGS, "depth", 0)
        _SETTINGS.depth = self.depth + 1

    def __exit__(self, *exc: Any) -> None:
        _SETTINGS.depth = self.depth
        if self.depth == 0:
            prior = _SETTINGS.__dict__.pop("prior", None)
            if prior:
                import torch._dynamo.config as dynamo_config

                for name, value in reversed(prior):
                    setattr(dynamo_config, name, value)


def _recompile_limit_for(cache_size: int) -> int:
    """At least `cache_size` compilations of a jitted function, so that one compiled per
    argument shape (`dynamic=False`) or static value may be compiled `cache_size` times, as
    documented, not Dynamo's default 8."""
    import torch._dynamo.config as dynamo_config

    return max(int(getattr(dynamo_config, "recompile_limit", 8)), cache_size)


def _recompile_limit(cache_size: int) -> Any:
    """`_recompile_limit_for` around a call, for a torch.compile without `recompile_limit=`."""
    import torch._dynamo.config as dynamo_config

    if not hasattr(dynamo_config, "recompile_limit"):  # pragma: no cover
        return contextlib.nullcontext()
    return dynamo_config.patch(recompile_limit=_recompile_limit_for(cache_size))


#: Dynamo's words for a HOP body with a side effect (torch 2.11-2.13).
_SIDE_EFFECT_MARKERS = (
    "Unsafe side effect",
    "input mutation during higher order op tracing",
    "Non-nullified side effect",
    "does not currently support input mutation",
)


def _repeats_a_zero_operand(text: str) -> bool:
    """Whether the control-flow node in a torch error's text takes one `zeros` node twice as an
    operand (`(..., %zeros, %zeros)`): a cotangent torch's autograd made, not a user's tensor."""
    for group in re.findall(r"\(\(?(%[^()]*)\)", text):
        names = [n.strip() for n in group.split(",") if n.strip().startswith("%")]
        if any(n.startswith("%zeros") and names.count(n) > 1 for n in names):
            return True
    return False


def _in_chain(e: BaseException, *texts: str) -> bool:
    """Whether one of `texts` is in the message of `e` or of an exception it was raised from."""
    seen: set[int] = set()
    c: BaseException | None = e
    while c is not None and id(c) not in seen:
        seen.add(id(c))
        if any(t in str(c) for t in texts):
            return True
        c = c.__cause__ or c.__context__
    return False


def _is_side_effect_error(e: BaseException) -> bool:
    return _in_chain(e, *_SIDE_EFFECT_MARKERS)


def _weak_init_in_a_body(e: BaseException) -> JitError | None:
    """The error for Dynamo's "unsafe side effect" refusal of tfun's weak-type run
    (`_hop.promote_weak_init`: a `TorchFunctionMode`, which torch.compile refuses inside some
    control-flow bodies) of a loop whose `init` holds a Python scalar, nested in another op's
    body; None if the refusal came from elsewhere. Hunt 30 F1: it was reported as a side
    effect of the user's code, with advice that did not apply."""
    seen = set()
    c: BaseException | None = e
    while c is not None and id(c) not in seen:
        seen.add(id(c))
        stack = list(getattr(c, "real_stack", None) or ())
        for k, fr in enumerate(stack):
            if fr.name == "promote_weak_init" and fr.filename.endswith("_hop.py") and k > 0:
                op = f"tfun.lax.{stack[k - 1].name}"
                fr_user = _innermost_user_frame(stack[:k])
                user = None if fr_user is None else f"{fr_user.filename}:{fr_user.lineno}"
                return JitError(
                    format_message(
                        f"{op}: its initial value holds a Python scalar (weakly typed, as in JAX), and the loop runs "
                        "inside the body of another control-flow op under tfun.jit. tfun gives such a scalar the "
                        "dtype the loop's body returns for it, by one run of the body under JAX's promotion rules "
                        "(a TorchFunctionMode), and torch.compile refused that run there."
                        + ("" if user is None else f"\n  * the loop is called at {user}"),
                        revise="Give the scalar its dtype: `torch.tensor(0.0)`, or `torch.zeros((), dtype=...)` of "
                        "the dtype the loop carries (eagerly, and in a loop at the top level of tfun.jit, the "
                        "Python scalar works).",
                    )
                )
        c = c.__cause__ or c.__context__
    return None


def _diagnose_eagerly(fun: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], err: BaseException) -> BaseException:
    """The error to raise when Dynamo refused a control-flow body for a side effect.

    Dynamo stops at the mutation without saying what was mutated, so `fun` is run once
    eagerly, where tfun's side-effect rules name it: their `SideEffectError` (the error the
    same program gets without `tfun.jit`) is raised in place of `err`. Should the eager run
    raise nothing, or another error, `err` (a `JitError`) is raised. The eager run is part
    of reporting the error only: its result is never returned.
    """
    from ._errors import SideEffectError

    try:
        fun(*args, **kwargs)
    except SideEffectError as eager:
        eager.dynamo_error = getattr(err, "dynamo_error", None)  # type: ignore[attr-defined]
        return eager
    except Exception as other:  # noqa: BLE001 - the JitError is the error to report
        err.eager_error = other  # type: ignore[attr-defined]  # kept for inspection
        return err
    return err


def _fake_tensor_assert(e: AssertionError) -> bool:
    """Whether `e` is Dynamo's assertion that a traced tensor has a fake value, which fails
    for a torch.func transform around some ops. torch 2.13 words it ("Expected FakeTensor");
    torch 2.11's is a bare `assert isinstance(fake_tensor, FakeTensor)`: its source line says."""
    if "Expected FakeTensor" in str(e):
        return True
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and "FakeTensor" in (frames[-1].line or "") and "torch" in frames[-1].filename


def _is_dynamo_error(e: BaseException) -> bool:
    try:
        from torch._dynamo.exc import TorchDynamoException
    except ImportError:  # pragma: no cover
        return False
    return isinstance(e, TorchDynamoException)



def _refuse_double_backward(out: Any, fn_text: str) -> None:
    """Hooks on the compiled function's outputs that refuse a backward with
    `create_graph=True` through them (a Hessian-vector product, a gradient penalty with
    `torch.autograd.grad(..., create_graph=True)`): torch.compile's backward has no derivative
    of its own, and torch 2.13 leaves its contribution out of the second derivative without an
    error (its own refusal hangs off a dummy tensor that autograd prunes; hunt 25). During a
    backward, grad mode is the backward's `create_graph`."""
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:

            def hook(g: torch.Tensor) -> None:
                if torch.is_grad_enabled():
                    raise JitError(
                        format_message(
                            f"tfun.jit: a gradient through the compiled `{fn_text}` was taken with "
                            "create_graph=True, to be differentiated again (a Hessian-vector product, a gradient "
                            "penalty). torch.compile's backward has no derivative of its own: torch "
                            f"{torch.__version__} would leave this function's part out of the second derivative "
                            "without an error.",
                            revise="Take both derivatives inside the compiled function (`tfun.jit(tfun.grad(lambda x: "
                            "penalty(tfun.grad(f)(x))))`, tfun.hessian, tfun.jvp of tfun.grad), or call the function "
                            "without tfun.jit where the gradient must stay differentiable.",
                        )
                    )

            t.register_hook(hook)


#: torch's warning when `.grad` of a non-leaf tensor is read (Dynamo reads it of each input)
_NON_LEAF_GRAD_WARNING = r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed"


def _prepared_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], bool]:
    """The arguments of a compiled call, and whether one is a non-leaf tensor that requires
    grad (see `Jitted.__call__`).

    Each tensor's lazy negation and conjugation bits are resolved (`z.conj().imag`,
    `z.conj()`: views that read their base negated or conjugated), which torch's control-flow
    ops have no kernel for (hunt 34 F2: every `cond` on such a tensor, every loop body reading
    one, was a JitError whose advice did not apply). The values are the same, and so are the
    gradients (`resolve_neg`/`resolve_conj` are differentiable copies). Where no tensor has a
    bit set (the usual case) the arguments are passed as they are: one flatten, nothing copied."""
    leaves, treedef = tree_flatten((args, kwargs))
    bits = non_leaf = False
    for x in leaves:
        if isinstance(x, torch.Tensor):
            bits = bits or x.is_neg() or x.is_conj()
            non_leaf = non_leaf or (x.requires_grad and x.grad_fn is not None)
    if not bits:
        return args, kwargs, non_leaf
    leaves = [x.resolve_neg().resolve_conj() if isinstance(x, torch.Tensor) else x for x in leaves]
    args, kwargs = tree_unflatten(treedef, leaves)
    return args, kwargs, True


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _symbolic_float_in_control_flow(e: BaseException) -> bool:
    """Whether torch refused a symbolic Python float (`SymFloat`) as an operand of a
    control-flow op: a float that a loop body or branch reads took a second value, and
    Dynamo, which does not specialize floats for Inductor, traced it as a symbol. torch's
    scan / while_loop / cond / map take closed-over values only as tensors or ints: Dynamo's
    fake run of the op refuses it, or (a float attribute, with gradients) AOTAutograd's
    partition of the op does (hunt 34 F5). A differentiated while_loop takes it as a 0-d
    tensor whose value its body reads back (`_local_scalar_dense`), which Inductor cannot
    lower in a subgraph ("KeyError: 'unbacked_bindings'")."""
    if _in_chain(e, "torch.SymFloat") and _in_chain(e, "can only be of", "Invalid arg types", "Invalid HopPartitionedGraph"):
        return True
    frames = _backend_raised(e)[1]
    return (
        bool(frames)
        and frames[-1].name == "_local_scalar_dense"
        and _in_chain(e, "unbacked_bindings")
        and _in_chain(e, "_graph_")
    )


def _symbolic_scan_length(e: BaseException) -> bool:
    """Whether Inductor failed to rebuild a scan's length from its operands: a scan (or a
    `fori_loop` with Python-int bounds) whose length is an expression of a symbolic size or
    int argument (`n - n // 2`, `n + 1`), whose symbols the scan's operands do not carry
    (Inductor's `decompose_scan_to_while_loop`, torch 2.11-2.14.1; hunt 34 F6)."""
    frames = _backend_raised(e)[1]
    return any(fr.name in ("resolve_shape_to_proxy", "lower_to_while_loop") for fr in frames)


def _names(found: list[str]) -> str:
    return found[0] if len(found) == 1 else ", ".join(found[:-1]) + " or " + found[-1]


def translate_error(
    e: BaseException,
    fn_text: str,
    cache_size: int | None = None,
    backend: Any = None,
    scalars: Callable[[type], list[str]] | None = None,
) -> BaseException:
    """A tfun error for an exception raised by Dynamo while compiling `fn_text`, or `e`.
    `backend`: the one tfun.jit compiled with (None: Inductor), so that the advice never names
    the backend that just failed. `scalars(kind)`: the call's non-static arguments that are
    Python scalars of that type, described, for advice about one of them."""
    try:
        from torch._dynamo.exc import BackendCompilerFailed, FailOnRecompileLimitHit, TorchDynamoException
    except ImportError:  # pragma: no cover
        return e
    if isinstance(e, FailOnRecompileLimitHit):
        import torch._dynamo.config as dynamo_config

        limit = int(getattr(dynamo_config, "recompile_limit", 8))
        if cache_size is not None:
            limit = max(limit, cache_size)
        err = JitError(
            format_message(
                f"tfun.jit: `{fn_text}` was called with more distinct argument shapes, dtypes or static values "
                f"than it may be compiled for (at most {limit} compilations; tfun.jit's cache_size is "
                f"{cache_size}, torch's recompile_limit {int(getattr(dynamo_config, 'recompile_limit', 8))}).",
                revise="Let sizes be symbolic (leave `dynamic` unset, or pass dynamic=True, instead of "
                "dynamic=False), pass a larger cache_size to tfun.jit, or pad the inputs to fewer distinct "
                "shapes.",
            )
        )
        err.dynamo_error = e  # type: ignore[attr-defined]
        return err
    if (isinstance(e, AssertionError) and _fake_tensor_assert(e)) or (
        _in_chain(e, "KeyError(<TransformType.") and _in_chain(e, "call_function cond", "call_function while_loop")
    ):
        # (the second: torch 2.13's cond under a traced jvp with grad mode off has no rule for
        # the transform, a KeyError of its functorch dispatch; hunt 34 F1)
        err = JitError(
            format_message(
                f"tfun.jit: could not compile `{fn_text}`: torch.compile cannot trace a torch.func "
                "transform (grad, vmap, jvp, ...) around a control-flow op (cond, scan, map, while_loop) in "
                f"torch {torch.__version__}. Inside tfun.jit, tfun.vmap, tfun.jvp, tfun.jacfwd, tfun.jacrev and "
                "tfun.hessian are such transforms; tfun.grad, tfun.value_and_grad and tfun.vjp are not (traced, "
                "they differentiate with autograd, which compiles to one graph).",
                revise="Apply the transform outside tfun.jit, around the jitted function: "
                "`tfun.vmap(tfun.jit(tfun.grad(loss)))` for per-example gradients, `tfun.hessian(tfun.jit(f))`, "
                f"`tfun.jacrev(tfun.jit(f))` ({_UNCOMPILED_OUTSIDE}); use `tfun.grad` / `tfun.vjp` instead of "
                "`torch.func.grad` / `vjp` inside `tfun.jit`; or compile the function without the transform "
                "and call `.backward()`.",
            )
        )
        err.dynamo_error = e  # type: ignore[attr-defined]
        return err
    if not isinstance(e, TorchDynamoException):
        return e
    inner = _hop.unwrap_dynamo_error(e)
    if inner is not None:
        inner.dynamo_error = e  # type: ignore[attr-defined]
        return inner
    where = _user_frame(e)
    revise = default_revise = (
        "Revise that line (tfun.lax ops instead of Python control flow on tensor values, no "
        "printing or .item() on traced tensors), or pass fullgraph=False to allow graph breaks."
    )
    bullets = [_headline(e)] + ([f"at {where}"] if where else [])
    if "SymInt with basic symbols" in str(e):
        # torch's scan/while_loop take a closed-over size only as a plain symbol: a size computed
        # from a dynamic shape (`n // 4`) and closed over by the body is refused
        revise = (
            "A loop body closes over a size computed from a dynamic shape (such as `h.shape[0] // 4`): "
            "compute it inside the body from a tensor it receives (`x.shape[0] // 4`, or `chunk`), or "
            "pass dynamic=False to tfun.jit to compile each shape on its own."
        )
    if _in_chain(e, "derivative for aten::detach_copy is not implemented"):
        # torch's scan HOP nested in a loop body, differentiated because its body reads a tensor
        # that requires grad (a module parameter): torch 2.13 cannot trace it (hunt 30 F3)
        revise = (
            "A loop (scan, or fori_loop with static bounds) inside another loop's body is differentiated "
            "(its body reads a tensor that requires grad, such as a module parameter), which torch "
            f"{torch.__version__}'s scan cannot trace. For inference, call the function under "
            "`torch.no_grad()` or pass detached parameters; to differentiate, unroll the inner loop "
            "(`unroll=True`: its steps then run in the outer body, as a one-step loop's do), or take the "
            "gradient eagerly."
        )
    if "Batching rule not implemented for aten::sym_size" in str(e):
        # tfun.vmap inside tfun.jit with symbolic sizes (a second call with another shape): torch
        # cannot trace a loop op (scan) on batched tensors whose sizes are symbols
        revise = (
            "A tfun.vmap inside tfun.jit maps a loop (scan, fori_loop, map) over tensors whose sizes are "
            f"symbolic (tfun.jit makes a size symbolic once it has seen it change), which torch "
            f"{torch.__version__} cannot trace. Pass dynamic=False to tfun.jit to compile each shape on its "
            "own, or apply tfun.vmap outside tfun.jit."
        )
    if "does not support RNG ops in recompute regions" in str(e):
        # torch.utils.checkpoint (tfun.checkpoint when traced) whose backward is computed in
        # the same graph (tfun.grad inside tfun.jit): torch cannot replay its random draws
        revise = (
            "A tfun.checkpoint function draws torch random numbers (dropout, torch.rand, ...) and its "
            "gradient is computed inside tfun.jit (tfun.grad), where torch 2.13 cannot recompute random "
            "draws. Draw them with tfun.random and an explicit key (pure ops, recomputed exactly), draw "
            "them outside the checkpointed function and pass them in, or jit only the forward pass and "
            "call .backward() on its result."
        )
    elif "BatchedTensor(" in str(e) and "autograd_function_apply" in str(e):
        # a custom_vjp/custom_jvp call inside tfun.vmap applies its rule outside the vmap
        # (`_custom_derivatives._traced_vmap_rule_call`): a tensor batched by the vmap that the
        # function or its rules close over cannot enter it
        revise = (
            "A tfun.custom_vjp or custom_jvp function called inside tfun.vmap closes over a tensor batched "
            "by that vmap (in the function or its rules): under tfun.jit its rule is applied outside the "
            "vmap, where such a tensor cannot follow. Pass the tensor to the custom function as an argument "
            "(a differentiable one; its cotangent may be None), or apply tfun.vmap outside tfun.jit."
        )
    elif "DispatchKey.Negative" in str(e) or "DispatchKey.Conjugate" in str(e):
        # a tensor with torch's lazy negation or conjugation bit (`z.conj().imag`,
        # `z.conj()`) reached a control-flow op, which has no kernel for those keys (hunt 34 F2);
        # tfun.jit resolves its arguments' bits, so here the loop body or branch closes over one
        revise = (
            "A loop body or cond branch closes over a tensor with torch's lazy negation or conjugation "
            "bit (such as `z.conj().imag` or `z.conj()`), which torch's control-flow ops cannot take. "
            "Resolve it where it is made (`x.resolve_neg()`, `z.resolve_conj()`), or pass it to the "
            "jitted function as an argument (tfun.jit resolves its arguments)."
        )
    elif "data-dependent expression" in str(e) or "PendingUnbackedSymbolNotFound" in str(e):
        # most often `xs[i]` with a loop index (a traced 0-d tensor) inside a loop body: torch
        # turns the index into an unbacked integer it cannot bound (docs/porting.md)
        revise = (
            "That line needs the value of a traced tensor as a Python int. Indexing a tensor with a loop "
            "index (`xs[i]` in a fori_loop or while_loop body, where `i` is a traced 0-d tensor) is the "
            "usual cause: write `tfun.at(xs)[i].get()` (`.set`/`.add` to write) or "
            "`torch.index_select(xs, 0, i.reshape(1))[0]`, or scan over `xs` instead. Otherwise keep the "
            "value a tensor (tfun.lax ops instead of Python control flow on it, no .item())."
        )
    elif "might be aliasing the input or the output" in str(e) and _repeats_a_zero_operand(str(e)):
        # torch's autograd gives two outputs of a cond one `zeros` cotangent, which the backward
        # cond then takes twice as an operand and refuses (hunt 24: a cond returning two integer
        # outputs, which cross it as float bits, in a differentiated loop body)
        revise = (
            "torch's autograd passed one zero cotangent for two outputs of a tfun.lax.cond (or switch) "
            "inside a differentiated loop, and torch's backward cond refuses an operand passed twice "
            f"(torch {torch.__version__}): this happens when the branches return two or more integer or "
            "bool outputs, or outputs nothing depends on. Return the integer outputs as one tensor "
            "(`torch.stack([i, j])`), compute them outside the cond, or differentiate outside tfun.jit "
            "(`tfun.jit(loss)` followed by `.backward()`)."
        )
    elif "do not support aliasing" in str(e) or "might be aliasing the input or the output" in str(e):
        # torch's HOPs refuse inputs that share memory: tfun clones aliased operands, but a
        # tensor a body or branch closes over is lifted by Dynamo unseen (`x[1]` read in a
        # branch whose operand is `x[0]`, two views of one input)
        revise = (
            "Two inputs of a tfun.lax op share memory: views of one tensor (such as `x[0]` as a cond operand "
            "and `x[1]` read inside the branch), which torch's control-flow ops refuse under "
            f"tfun.jit (torch {torch.__version__}). Pass a copy for one of them (`x[0].clone()`), or pass the "
            "whole tensor as an operand and index it inside the function."
        )
    elif "does not support automatic differentiation for outputs with complex dtype" in str(e):
        # torch's loop autograd re-traces the body functionalized, where a complex carry's
        # conjugation (`_conj_copy`) or a complex intermediate's view (`view_as_complex_copy`)
        # is a copy op with no derivative for complex outputs (hunt 24, finding 10)
        found = re.search(r"'?(\w+) does not support automatic differentiation for outputs with complex dtype", str(e))
        culprit = f" (here `{found.group(1)}`)" if found else ""
        revise = (
            "A differentiated tfun.lax loop (scan, fori_loop, map) computes with complex tensors in its body: "
            "a complex carry, or a complex intermediate such as `torch.view_as_complex(...)` or "
            "`torch.complex(re, im)` with a real carry. torch's loop autograd re-traces the body with views "
            f"turned into copies, and those copies{culprit} have no derivative for complex outputs under tfun.jit "
            f"(torch {torch.__version__}). The loop is differentiated when its body reads a tensor that requires "
            "grad (a module parameter, such as those a `tfun.nn` layer's `step` reads): for inference, call the "
            "function under `torch.no_grad()`. To differentiate, write the body's complex arithmetic on real and "
            "imaginary parts as real tensors (`(a + ib)(c + id) = (ac - bd) + i(ad + bc)`, as the `forward` of "
            "tfun.nn's S5 and LRU does), or compute the gradient outside tfun.jit (eagerly it is right)."
        )
    elif "outs_to_grad length" in str(e) and "!= tangents length" in str(e):
        # torch's while_loop autograd counts the outputs to differentiate without complex ones
        # and the tangents with them (a differentiated while_loop with a complex carry, hunt
        # 28); tfun encodes integer outputs, so a real while_loop does not get here
        revise = (
            "A differentiated tfun.lax.while_loop (or a fori_loop with tensor bounds) has a complex carry, "
            "whose derivative torch's while_loop autograd cannot compute under tfun.jit (torch "
            f"{torch.__version__}), with any backend. Carry the real and imaginary parts as real tensors "
            "(`(a + ib)(c + id) = (ac - bd) + i(ad + bc)`), use a fori_loop with Python-int bounds or a scan "
            "(JAX's while_loop has no reverse-mode derivative either), or compute the gradient outside "
            "tfun.jit (eagerly it is right)."
        )
    elif "Expected at least one Tensor to vmap over" in str(e) or (
        "sorted order of strides of the two branches" in str(e) and "BatchedTensor(" in str(e)
    ):
        # torch.cond's vmap rule with an unbatched predicate vmaps each branch over the branch's
        # own inputs: a branch that reads only unbatched ones has nothing to vmap over (switch),
        # or returns an unbatched output that the rule expands (stride 0) beside a batched one (cond)
        revise = (
            "A tfun.lax.cond or switch under a tfun.vmap inside tfun.jit has a branch that reads only "
            "unbatched tensors while another reads a batched one, which torch's batching of `torch.cond` "
            f"cannot compile (torch {torch.__version__}). Make the operands batched, so that every branch "
            "returns batched values (e.g. `torch.zeros_like(x)` rather than `torch.zeros(n)` for a value one "
            "branch adds the batched `x` to), or apply tfun.vmap outside tfun.jit."
        )
    elif _in_chain(e, "duplicate argument"):
        # torch.cond's speculation (Dynamo's `_merge_graph_inputs`) gave two inputs of a branch
        # graph one name: both branches of a cond in a loop body read a tensor that a traced
        # tfun.grad differentiates (hunt 23)
        revise = (
            "torch.cond's tracing gave two inputs of a branch graph the same name (torch "
            f"{torch.__version__}): both branches of a tfun.lax.cond or switch inside a loop body read a tensor "
            "that tfun.grad differentiates inside tfun.jit (closed over or passed as an operand). Compute what "
            "needs that tensor before the cond and pass the result as the operand (`cond(p, torch.sin, "
            "torch.cos, h @ w)` rather than `cond(p, lambda a: torch.sin(a @ w), lambda a: torch.cos(a @ w), "
            "h)`), let only one branch read it, or compile the loss alone (`tfun.jit(loss)`) and call "
            "`.backward()` on its result."
        )
    elif "disjoint backward regions" in str(e):
        # two tfun.grad (or a grad of a grad) inside one tfun.jit over tfun.checkpoint functions
        revise = (
            "The graph computes two gradients through tfun.checkpoint functions (tfun.grad of tfun.grad, "
            "or two tfun.grad calls), and torch 2.13 rematerializes for only one gradient per graph. Jit "
            "each gradient on its own, take the outer derivative outside tfun.jit, or drop tfun.checkpoint "
            "where its gradient is differentiated again."
        )
    if revise is default_revise and _in_chain(
        e, "does not require grad and does not have a grad_fn", "Unsupported Tensor.requires_grad_() call"
    ):
        # torch.autograd.grad (or .backward()) inside a loop body or branch, on a tensor the body
        # made require grad: torch runs control-flow bodies with autograd off when it traces
        # them, so the gradient has no graph (hunt 34 F4); tfun.grad is traced through
        revise = (
            "A gradient is taken with `torch.autograd.grad` or `.backward()` of a tensor that does not require "
            "grad in the traced graph. Inside a loop body or cond branch (an energy gradient in a Langevin or "
            "optimization step) this is always so under tfun.jit: torch traces control-flow bodies with "
            "autograd off, and `requires_grad_()` there has no effect. Write it as `tfun.grad(energy)(x)` (no "
            "`detach`, `requires_grad_` or `enable_grad` needed): traced, tfun.grad compiles into the loop, in "
            "every grad mode. Outside control flow, make sure the tensor requires grad (as eagerly)."
        )
    elif revise is default_revise and _in_chain(e, "is not lowered to while_loop"):
        # Inductor's passes that rewrite scan and map as while_loop leave a loop with complex
        # operands alone and then assert (2.11-2.14.1); tfun's own complex inputs and outputs
        # cross as real pairs where the loop is not differentiated, a lifted closure cannot
        bullets = [_backend_failure(e)]
        revise = (
            f"Inductor (torch {torch.__version__}) cannot compile a loop (scan, fori_loop, map) that reads or "
            "returns a complex tensor. tfun passes a loop's complex init, xs and outputs across as real pairs "
            "where the loop is not differentiated, but a complex tensor its body closes over (a complex weight) "
            "reaches the loop as it is: close over its real view instead (`Wr = torch.view_as_real(W)` outside "
            "the loop, `torch.view_as_complex(Wr)` inside the body), or pass backend=\"aot_eager\". A "
            "differentiated loop (one whose body reads a tensor that requires grad) cannot carry complex "
            "values: for inference call it under `torch.no_grad()`, else compute with real and imaginary parts."
        )
    elif revise is default_revise and _symbolic_float_in_control_flow(e):
        floats = scalars(float) if scalars is not None else []
        which = (
            f"(in this call {_names(floats)}, or an attribute the body reads)"
            if floats
            else "(an argument of the jitted function, or an attribute such as a module's `self.scale` or a "
            "config value)"
        )
        bullets = [
            f"a Python float that a loop body or cond branch reads {which} took a new value since the first "
            "call, so torch.compile now traces it as a symbolic float, which torch "
            f"{torch.__version__}'s control-flow ops cannot take"
        ] + ([f"at {where}"] if where else [])
        revise = (
            "Pass the float as a tensor (`torch.tensor(lr)`: compiled once for every value, as jax.jit traces a "
            "Python float), mark the argument static (`static_argnums`/`static_argnames`: compiled once per "
            "value), or pass dynamic=False to tfun.jit (every value of a float is then compiled on its own; "
            "backend=\"aot_eager\" does the same)."
        )
    elif revise is default_revise and isinstance(e, BackendCompilerFailed) and _symbolic_scan_length(e):
        ints = scalars(int) if scalars is not None else []
        which = f" (in this call {_names(ints)})" if ints else ""
        bullets = [_backend_failure(e)]
        revise = (
            "A scan, or a fori_loop with Python-int bounds, runs for a number of steps computed from a size or "
            f"an int argument{which} that tfun.jit traces as a symbol (it has seen it change): `fori_loop(n // "
            "2, n, ...)`, a scan over `xs[:n + 1]`. torch's Inductor cannot compile a scan whose length is such "
            f"an expression (torch {torch.__version__}; a length that is the size or int itself, "
            "`fori_loop(0, n, ...)`, compiles). Mark the int static (`static_argnums`: compiled once per value), "
            "pass the bounds as tensors (`fori_loop(torch.tensor(lo), torch.tensor(n), ...)`: a while_loop), "
            "pass dynamic=False to tfun.jit, or backend=\"aot_eager\"."
        )
    warning = _raised_warning(e) if revise is default_revise else None
    if warning is not None:
        # a warning the compiler (or torch's tracing) issued, raised as an exception because the
        # caller's warnings filter says so (`-W error`, pytest's filterwarnings = ["error"]):
        # on an H100 Inductor's TF32 advice failed every compile of a test suite that way
        bullets = [f"{type(warning).__name__}: {(str(warning).strip().splitlines() or [''])[0][:300]}"]
        bullets += [f"at {where}"] if where and not isinstance(e, BackendCompilerFailed) else []
        revise = (
            "That is a warning issued while compiling, raised as an exception because the warnings filter in "
            "effect turns warnings into errors (`python -W error`, `warnings.simplefilter(\"error\")`, pytest's "
            "filterwarnings = [\"error\"]); it is not a failure of the compiler nor of your code. Ignore that "
            f"warning in the filter (e.g. `warnings.filterwarnings(\"ignore\", message=r\"{_warning_pattern(warning)}\")`), "
            "or let warnings be warnings while tfun.jit compiles."
        )
    elif revise is default_revise and isinstance(e, BackendCompilerFailed) and _failed_tracing_control_flow(e):
        # torch's own tracing of a loop for autograd failed (under a torch.func transform, most
        # often): every backend runs it, so aot_eager would fail the same way
        bullets = [_backend_failure(e)]
        revise = (
            "Tracing succeeded and torch then failed to trace a control-flow op (scan, while_loop, cond, "
            "...) for autograd, which every backend does (backend=\"aot_eager\" too): a limitation of the "
            "installed torch, not of your code. Apply a tfun.vmap or tfun.jvp that is inside tfun.jit "
            f"outside it instead (`tfun.vmap(tfun.jit(tfun.grad(loss)))`: {_UNCOMPILED_OUTSIDE}), jit the "
            "forward only and call .backward() on its result, or call the function outside tfun.jit."
        )
    elif revise is default_revise and isinstance(e, BackendCompilerFailed):
        # traced, then the compiler (Inductor) failed on the graph: nothing in the user's code
        bullets = [_backend_failure(e)]
        revise = (
            "Tracing succeeded and the compiler backend failed on the traced graph: a limitation of the "
            "installed torch, not of your code. "
            + (
                "Call the function outside tfun.jit (it failed on the aot_eager backend, which only traces: "
                "Inductor fails too)."
                if backend == "aot_eager"
                else "Leave out the backend option that fails (Inductor's cpp_wrapper fails on some loop "
                "programs: docs/performance.md), pass backend=\"aot_eager\" to tfun.jit, or call the function "
                "outside tfun.jit."
            )
        )
    err = JitError(
        format_message(f"tfun.jit: could not compile `{fn_text}` as one graph:", bullets, revise=revise)
    )
    err.dynamo_error = e  # type: ignore[attr-defined]
    return err
