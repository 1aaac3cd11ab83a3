"""`tfun.jit` on CUDA: a call replayed from a CUDA graph (`cuda_graphs="auto"`, the default,
or `True`).

A loop of small steps on a GPU is bound by the host: under plain `torch.compile` each step's
kernels are launched from Inductor's Python wrapper, about 25-40 us a step on an H100 whatever
the step computes. A CUDA graph records every kernel of one call and replays them with one
launch. Measured on an H100 (torch 2.11, `python benchmarks/cuda_graphs.py`, 2026-11-27), the
tanh RNN of benchmarks/vs_jax.py (T=1024): B=4, H=32 forward 39.7 -> 3.8 ms (jax.jit: 6.8 ms);
B=64, H=256 forward+backward (`tfun.grad` of the loss) 138 -> 27 ms (jax.jit: 18 ms).
`mode="reduce-overhead"` (Inductor's CUDA graph trees) crashes on these programs in torch 2.11
("storage data ptrs are not allocated in pool"), so tfun records the compiled function itself.

How a call of a jitted function with CUDA tensor arguments runs (`GraphCache.call`), per
*signature* (the static arguments, the pytree structure of the others, each tensor's shape,
strides, dtype, device and `requires_grad`, each non-tensor leaf's value, and grad mode):

1. The first call runs the compiled function as usual (compiling it), and looks at what it
   returned.
2. The second call decides. The signature is recorded only if all of these hold (the first
   that fails is the reason, logged on the `tfun.jit` logger at INFO; with
   `cuda_graphs=True` it is a `JitError`; `"auto"` checks all of them):
   - every tensor argument and result is on one CUDA device, and no result requires grad
     (a result that requires grad continues into autograd outside the call, which a graph
     cannot replay: differentiate inside, `tfun.jit(tfun.value_and_grad(loss))`, as in JAX);
   - Dynamo captures the function as one graph, and that graph reads no tensor that is not
     an argument (a closed-over tensor, a module's parameter: replaying would read that
     memory even after the name is rebound to a new tensor) and writes into no argument
     (the graph's copy of it would be written, not the caller's);
   - one call, run on copies of the arguments, does not synchronize with the host
     (`torch.cuda.set_sync_debug_mode("error")`: a `while_loop` whose predicate is on the
     GPU reads it back every step, `.item()`, `nonzero`...).
   Then a third run on those copies is captured in a `torch.cuda.CUDAGraph`.
3. Every later call with that signature first checks Dynamo's guards for it (`GuardProbe`:
   what the compiled graph assumed of its arguments, of the values it closes over, of module
   flags such as `training` and of torch's global settings). If they still hold, it copies
   the tensor arguments into the graph's copies, replays the graph, and returns copies of its
   results (the graph overwrites its own on the next replay; a result must stay yours).
   Random numbers drawn with torch's generator advance on each replay, as they would
   eagerly. If they do not hold (a replay would run kernels compiled for the old value), the
   graph is dropped and the call runs as compiled (Dynamo recompiles); the signature is
   decided again, and after a second such change it is not recorded any more.

At most `cache_size` graphs are kept per jitted function (least recently used first out);
each holds its arguments, results and intermediates in a memory pool of its own.
`"auto"` records at most `AUTO_MAX_GRAPHS` (8) signatures per function, and no call whose
tensor arguments take more than `AUTO_MAX_ARGUMENT_BYTES` (256 MiB); `cuda_graphs=False`
turns this off; `True` makes any reason not to record an error (a closed-over tensor is then
accepted: you promise to update it in place only, as `torch.cuda.make_graphed_callables`
asks) and records up to `cache_size` signatures. `Jitted.cuda_graph_reasons()` lists what
was decided per signature.

Status (2026-11-27): on an H100 and an H200 the replays gave eager's values to the last bit
(`benchmarks/cuda_graphs.py`, strategy `tfun_cuda_graphs`), and the recorded training steps of
`python -m tests.gpu.check_cuda --paths inductor+grad+graphs` matched float64.
tests/test_cuda_graphs.py's CUDA tests failed on the first two GPU runs (the debug mode was
not put back after a recording, as torch 2.11 warns that the mode is a prototype after
setting it; the checking run compiled again on its side stream, so every training step was
refused) and passed on an H100 in session 17 once those were fixed (three had failed only on
Inductor's TF32 advice, a warning, under warnings-as-errors); "auto" became the default then.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import operator
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import _compat
from ._errors import JitError, format_message
from ._tree import tree_flatten, tree_unflatten

__all__ = ["GraphCache", "applies", "available"]

log = logging.getLogger("tfun.jit")

#: The device type whose calls are recorded (tests put "cpu" here, with stand-ins for the
#: torch.cuda calls, to check the recording logic on a machine without a GPU).
DEVICE_TYPE = "cuda"

_VIEWS = frozenset(
    {
        "__getitem__", "getitem", "view", "reshape", "transpose", "t", "select", "narrow", "unsqueeze",
        "squeeze", "expand", "permute", "as_strided", "flatten", "unflatten", "view_as", "expand_as",
        "movedim", "swapaxes", "unbind", "split", "chunk", "diagonal", "real", "imag", "mT", "T",
    }
)
_INPLACE_OPERATORS = frozenset(
    {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
     operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
     operator.imatmul, operator.setitem}
)


def available() -> bool:
    """Whether calls may be recorded here at all (a CUDA device is present)."""
    return torch.cuda.is_available()


def applies(options: dict[str, Any]) -> bool:
    """Whether tfun records graphs for these `torch.compile` options: not where torch already
    does (`mode="reduce-overhead"`/`"max-autotune"`, Inductor's `triton.cudagraphs`, the
    `cudagraphs` backend)."""
    mode = options.get("mode") or ""
    if "reduce-overhead" in mode or mode == "max-autotune":
        return False
    if options.get("backend") == "cudagraphs":
        return False
    return not (options.get("options") or {}).get("triton.cudagraphs", False)


class _Entry:
    __slots__ = ("calls", "graph", "static", "out_leaves", "out_def", "reason", "text", "guards", "invalidated")

    def __init__(self, text: str = "") -> None:
        self.text = text  # the signature, for people (`GraphCache.reasons`)
        self.calls = 0
        self.guards: list[Any] = []  # Dynamo's guards that held when the graph was recorded
        self.invalidated = 0  # how often those guards failed before a replay
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: list[torch.Tensor] = []
        self.out_leaves: list[Any] = []
        self.out_def: Any = None
        self.reason: str | None = None


class _Unhashable(Exception):
    pass


def _signature(static_key: Any, leaves: list[Any], treedef: Any) -> tuple[Any, ...]:
    sig: list[Any] = [static_key, treedef, torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            sig.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad))
        else:
            try:
                hash(leaf)
            except TypeError:
                raise _Unhashable(type(leaf).__qualname__) from None
            sig.append((type(leaf), leaf))
    return tuple(sig)


def _signature_text(static_key: Any, leaves: list[Any]) -> str:
    """`(f32[64, 256] cuda:0, f32[1024, 64, 256] cuda:0, 3; static n=3; grad off)`."""
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            dtype = str(leaf.dtype).replace("torch.", "")
            grad = " requires_grad" if leaf.requires_grad else ""
            parts.append(f"{dtype}[{', '.join(map(str, leaf.shape))}] {leaf.device}{grad}")
        else:
            parts.append(repr(leaf))
    text = ", ".join(parts)
    if static_key:
        text += "; static " + ", ".join(f"{k}={v!r}" for k, v in static_key)
    return f"({text}; grad {'on' if torch.is_grad_enabled() else 'off'})"


def _chain(e: BaseException | None) -> list[BaseException]:
    out: list[BaseException] = []
    while e is not None and len(out) < 16:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _sync_error(e: BaseException) -> str | None:
    """The first line of the synchronization error behind `e` (tfun.jit may have wrapped it)."""
    for x in _chain(e):
        for line in str(x).splitlines():
            if _SYNC_MESSAGE in line:
                return line.strip()
    return None


#: what torch raises for a synchronizing operation under `set_sync_debug_mode("error")`
_SYNC_MESSAGE = "called a synchronizing CUDA operation"


def _root_placeholder(node: Any) -> Any:
    """The placeholder a chain of views starts from, or None."""
    seen = 0
    while node is not None and seen < 64:
        seen += 1
        if getattr(node, "op", None) == "placeholder":
            return node
        if getattr(node, "op", None) in ("call_method", "call_function"):
            name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
            if name in _VIEWS and node.args:
                node = node.args[0]
                continue
        return None
    return None


def graph_reason(graph_modules: list[torch.fx.GraphModule], n_tensor_args: int) -> str | None:
    """Why the Dynamo graph(s) of a call cannot be replayed from a CUDA graph by default, or None."""
    if len(graph_modules) != 1:
        return f"Dynamo captured {len(graph_modules)} graphs (graph breaks), not one"
    (gm,) = graph_modules
    arg_placeholders = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value = node.meta.get("example_value")
            if not isinstance(value, torch.Tensor):
                continue
            if node.name.startswith(("l_dyn_", "l_kw_")):
                arg_placeholders += 1
            else:
                return (
                    f"it reads a tensor that is not an argument (`{node.name}`: a closed-over tensor, a global or a "
                    "module's parameter); pass it as an argument (a module's parameters as a dict: "
                    "`torch.func.functional_call(model, params, (x,))` inside the function), or pass "
                    "cuda_graphs=True if it is only ever updated in place"
                )
        elif node.op in ("call_method", "call_function"):
            target = node.target
            name = target if isinstance(target, str) else getattr(target, "__name__", "")
            inplace = target in _INPLACE_OPERATORS or (
                isinstance(name, str) and name.endswith("_") and not name.startswith("_") and name != "requires_grad_"
            )
            if inplace and node.args and _root_placeholder(node.args[0]) is not None:
                return f"it writes into an argument in place (`{name}`)"
    if arg_placeholders > n_tensor_args:  # placeholder names not as expected: do not guess
        return "its graph's inputs could not be matched with its arguments"
    return None


#: How many signatures of one jitted function `cuda_graphs="auto"` records (each graph holds
#: its arguments, results and intermediates in a memory pool of its own, for as long as it is
#: kept); later signatures run as compiled, with that reason.
AUTO_MAX_GRAPHS = 8

#: `cuda_graphs="auto"` does not record a call whose tensor arguments take more than this
#: many bytes: the graph keeps a copy of each argument for as long as it is
#: kept, so a training step of a large model would hold a second copy of its parameters. Such
#: calls are rarely bound by kernel launches anyway.
AUTO_MAX_ARGUMENT_BYTES = 256 * 2**20


class GraphCache:
    """The CUDA graphs of one jitted function, one per call signature (see the module)."""

    def __init__(self, required: bool, fn_text: str, max_entries: int, max_graphs: int | None = None) -> None:
        self.required = required
        self.fn_text = fn_text
        self.max_entries = max_entries
        # "auto" (the default) records at most `AUTO_MAX_GRAPHS` signatures: each graph keeps
        # its own memory; `True` records up to `max_entries`
        self.max_graphs = max_graphs if max_graphs is not None else (
            max_entries if required else min(max_entries, AUTO_MAX_GRAPHS))
        self.entries: collections.OrderedDict[Any, _Entry] = collections.OrderedDict()
        self.lock = threading.Lock()

    def reasons(self) -> list[tuple[str, str]]:
        """(signature, decision) for each signature seen."""
        out = []
        for e in self.entries.values():
            state = "replayed from a CUDA graph" if e.graph is not None else (e.reason or "not decided yet (one call)")
            out.append((e.text, state))
        return out

    def _refuse(self, entry: _Entry, reason: str) -> None:
        entry.reason = "not recorded: " + reason
        if self.required:
            raise JitError(
                format_message(
                    f"tfun.jit: cuda_graphs=True, but a call of `{self.fn_text}` cannot be replayed from a CUDA graph: "
                    f"{reason}.",
                    revise="Change what the reason names, or leave cuda_graphs out (tfun.jit then runs such calls "
                    "without a graph).",
                )
            )
        log.info("tfun.jit: `%s` runs without a CUDA graph: %s", self.fn_text, reason)

    def call(
        self,
        static_key: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        run: Callable[..., Any],
        lower: Callable[[], list[torch.fx.GraphModule]],
        guards: GuardProbe | None = None,
    ) -> Any:
        """`run(*args, **kwargs)`, or its replay. `lower()` gives the call's Dynamo graphs;
        `guards` checks Dynamo's guards for this call (None: a graph is never replayed after
        Dynamo's state may have changed, so nothing is recorded)."""
        leaves, treedef = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        if not any(t.device.type == DEVICE_TYPE for t in tensors):
            return run(*args, **kwargs)  # a call on the CPU (or of no tensor): nothing to record
        try:
            sig = _signature(static_key, leaves, treedef)
        except _Unhashable as e:
            if self.required:
                entry = _Entry()
                self._refuse(entry, f"an argument of type {e} is neither a tensor nor hashable")
            return run(*args, **kwargs)
        with self.lock:
            entry = self.entries.get(sig)
            if entry is None:
                entry = self.entries[sig] = _Entry(_signature_text(static_key, leaves))
                while len(self.entries) > self.max_entries:
                    self.entries.popitem(last=False)
            else:
                self.entries.move_to_end(sig)
            entry.calls += 1
            if entry.graph is not None and not guards_hold(guards, entry.guards):
                # what the graph was compiled for no longer holds (a closed-over Python value,
                # a module's `training` flag, a global torch setting: Dynamo would recompile),
                # and a replay would run the old kernels: drop it, run as compiled, decide again
                entry.invalidated += 1
                entry.graph, entry.static, entry.out_leaves, entry.guards = None, [], [], []
                entry.calls = 1
                if entry.invalidated >= 2:
                    self._refuse(entry, "what Dynamo compiled it for changed after it was recorded, twice (a "
                                 "closed-over Python value, a module flag such as `training`, or a global torch "
                                 "setting that changes between calls)")
                return run(*args, **kwargs)
            if entry.graph is not None:
                for s, t in zip(entry.static, tensors):
                    s.copy_(t)
                entry.graph.replay()
                out = [o.clone() if isinstance(o, torch.Tensor) else o for o in entry.out_leaves]
                return tree_unflatten(entry.out_def, out)
            if entry.reason is not None or entry.calls == 1:
                out = run(*args, **kwargs)
                if entry.calls == 1:
                    reason = _result_reason(out, tensors)
                    if reason is None and not self.required:
                        reason = _device_reason(tensors)
                    if reason is not None:
                        self._refuse(entry, reason)
                return out
            return self._record(entry, args, kwargs, leaves, treedef, tensors, run, lower, guards)

    def _record(
        self,
        entry: _Entry,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        treedef: Any,
        tensors: list[torch.Tensor],
        run: Callable[..., Any],
        lower: Callable[[], list[torch.fx.GraphModule]],
        guards: GuardProbe | None,
    ) -> Any:
        reason = _device_reason(tensors)
        held = guards.holding() if guards is not None else None
        if reason is None and held is None:
            reason = ("this torch does not let tfun check Dynamo's guards before a replay (a replay would not "
                      "notice a closed-over value or setting that changed)")
        elif reason is None and not held:
            reason = "no compiled graph of Dynamo's matches this call's arguments"
        recorded = sum(e.graph is not None for e in self.entries.values())
        arg_bytes = sum(t.numel() * t.element_size() for t in tensors)
        if reason is None and not self.required and arg_bytes > AUTO_MAX_ARGUMENT_BYTES:
            reason = (
                f"its tensor arguments take {arg_bytes / 2**20:.0f} MiB, and a graph keeps a copy of them (over "
                f"{AUTO_MAX_ARGUMENT_BYTES // 2**20} MiB, \"auto\" does not record; cuda_graphs=True does)"
            )
        if reason is None and recorded >= self.max_graphs:
            reason = (
                f"{recorded} signatures of this function are recorded already, each graph keeping its own memory "
                "(arguments, results, intermediates); cuda_graphs=True records up to cache_size"
            )
        if reason is None and not self.required:
            try:
                reason = graph_reason(lower(), len(tensors))
            except Exception as e:  # noqa: BLE001 - a reason not to record, said (the call itself compiled)
                reason = f"Dynamo could not trace it again to inspect its graph ({type(e).__name__}: {str(e)[:200]})"
        if reason is not None:
            self._refuse(entry, reason)
            return run(*args, **kwargs)
        device = tensors[0].device
        static = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
        it = iter(static)
        static_leaves = [next(it) if isinstance(t, torch.Tensor) else t for t in leaves]
        s_args, s_kwargs = tree_unflatten(treedef, static_leaves)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        # Three runs on the copies, all on the side stream: a warm-up in the caller's mode (it
        # compiles whatever running on another stream or with the copies asks for: compiling
        # synchronizes, and must not happen in "error" mode or while capturing), a check with
        # synchronization an error (the caller's mode is put back in the `finally` whatever
        # happens: the capture below synchronizes itself), then the capture.
        failure: Exception | None = None
        with torch.cuda.stream(side):
            run(*s_args, **s_kwargs)
            try:
                with _synchronizing_is_an_error():
                    run(*s_args, **s_kwargs)
            except Exception as e:  # noqa: BLE001 - only a synchronization is a reason; the rest is raised below
                failure = e
        torch.cuda.current_stream(device).wait_stream(side)
        if failure is not None:
            message = _sync_error(failure)
            if message is None:
                raise failure
            log.debug("tfun.jit: the synchronizing call's traceback", exc_info=failure)
            self._refuse(entry, f"a call synchronizes with the host ({message})")
            return run(*args, **kwargs)
        graph = torch.cuda.CUDAGraph()
        try:
            out = _capture(graph, device, side, lambda: run(*s_args, **s_kwargs))
        except Exception as e:  # noqa: BLE001 - CUDA refused to record an operation: said, then run as usual
            del graph
            first = next((str(x).splitlines()[0] for x in _chain(e) if str(x)), type(e).__name__)
            log.debug("tfun.jit: the capture's traceback", exc_info=e)
            self._refuse(entry, f"CUDA could not record it ({first})")
            return run(*args, **kwargs)
        out_leaves, out_def = tree_flatten(out)
        entry.graph, entry.static, entry.out_leaves, entry.out_def = graph, static, out_leaves, out_def
        entry.guards = held or []
        entry.reason = None
        for s, t in zip(static, tensors):
            s.copy_(t)
        graph.replay()
        return tree_unflatten(out_def, [o.clone() if isinstance(o, torch.Tensor) else o for o in out_leaves])


class GuardProbe:
    """Dynamo's guards for one call of a `torch.compile`d function (`tfun._compat`): which of
    its compiled graphs' guards hold for these arguments now (`holding`, when a graph is
    recorded), and whether the ones that held then still do (`still`, before each replay).
    A replay runs recorded kernels without Dynamo, so without this check it would keep
    running a graph compiled for a closed-over value or setting that has since changed."""

    __slots__ = ("compiled", "args", "kwargs")

    def __init__(self, compiled: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.compiled, self.args, self.kwargs = compiled, args, kwargs

    def holding(self) -> list[Any] | None:
        """The guards that hold now, or None where this torch does not expose them."""
        checks = _compat.dynamo_guards(self.compiled)
        if checks is None:
            return None
        frame = _compat.dynamo_frame_locals(self.compiled, self.args, self.kwargs)
        return [c for c in checks if c.check(frame)]

    def still(self, checks: list[Any]) -> bool:
        frame = _compat.dynamo_frame_locals(self.compiled, self.args, self.kwargs)
        return all(c.check(frame) for c in checks)


def guards_hold(probe: GuardProbe | None, checks: list[Any]) -> bool:
    """Whether a graph recorded while `checks` held may be replayed for this call."""
    return probe is not None and bool(checks) and probe.still(checks)


@contextlib.contextmanager
def _synchronizing_is_an_error() -> Iterator[None]:
    """CUDA's synchronization debug mode "error" inside, the caller's mode put back after,
    whatever happens. torch warns that the mode is a prototype each time it is set (a
    `UserWarning`, an exception where warnings are errors, raised after the mode was set):
    that warning is tfun's business here, not the caller's."""
    previous = torch.cuda.get_sync_debug_mode()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype", category=UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _capture(graph: torch.cuda.CUDAGraph, device: torch.device, stream: Any, fn: Callable[[], Any]) -> Any:
    """`fn()`, its CUDA work recorded into `graph` on `stream` (the stream the warm-up and the
    check ran on: a compiled function may be specialized to the stream it runs on)."""
    with torch.cuda.device(device):
        with torch.cuda.graph(graph, stream=stream):
            return fn()


def _device_reason(tensors: list[torch.Tensor]) -> str | None:
    devices = {t.device for t in tensors}
    if len(devices) != 1 or next(iter(devices)).type != DEVICE_TYPE:
        return "its tensor arguments are not all on one CUDA device (" + ", ".join(sorted(map(str, devices))) + ")"
    return None


def _result_reason(out: Any, tensors: list[torch.Tensor]) -> str | None:
    devices = {t.device for t in tensors}
    for leaf in tree_flatten(out)[0]:
        if isinstance(leaf, torch.Tensor):
            if leaf.device not in devices or leaf.device.type != DEVICE_TYPE:
                return f"a result is on {leaf.device}, not on the arguments' CUDA device"
            if leaf.requires_grad:
                return (
                    "a result requires grad (autograd continues outside the call; compute the gradient inside, "
                    "e.g. tfun.jit(tfun.value_and_grad(loss)), with arguments that do not require grad: "
                    "`p.detach()` of a parameter shares the memory its optimizer updates; or call it under "
                    "torch.no_grad())"
                )
    return None
