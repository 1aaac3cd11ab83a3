"""tfun.jit's CUDA graphs (`cuda_graphs=`, tfun/_cuda_graphs.py).

The decisions that need no GPU (what a graph may read and write, the options, CPU calls
untouched) run everywhere; the recording and replaying run where CUDA is (the device
machine: `benchmarks/gpu_session.sh`), each compared with the same function run eagerly over
several calls with different arguments.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import tfun
from tfun import _compat, _cuda_graphs
from tfun.errors import JitError

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _sync_mode_is_put_back():
    yield
    if torch.cuda.is_available():  # a recording must leave the caller's debug mode as it was
        assert torch.cuda.get_sync_debug_mode() == 0

W_GLOBAL = torch.randn(3, 3)


def _reason(fn, *args):
    lowered = tfun.jit(fn).lower(*args)
    n = sum(isinstance(t, torch.Tensor) for t in tfun.tree.tree_leaves(args))
    return _cuda_graphs.graph_reason(lowered.graph_modules, n)


def rnn(W, xs, h0):
    return tfun.lax.scan(lambda h, x: (lambda n: (n, n))(torch.tanh(h @ W + x)), h0, xs)


def test_a_function_of_its_arguments_may_be_recorded():
    assert _reason(rnn, torch.randn(3, 3), torch.randn(5, 2, 3), torch.zeros(2, 3)) is None
    assert _reason(lambda d: {"y": d["a"] * 2 + d["b"]}, {"a": torch.ones(2), "b": torch.ones(2)}) is None


def test_a_closed_over_tensor_or_parameter_is_a_reason():
    W = torch.randn(3, 3)
    assert "not an argument" in _reason(lambda x: x @ W, torch.randn(2, 3))
    assert "not an argument" in _reason(lambda x: x @ W_GLOBAL, torch.randn(2, 3))
    lin = torch.nn.Linear(3, 3)
    assert "not an argument" in _reason(lambda x: lin(x), torch.randn(2, 3))


def test_writing_into_an_argument_is_a_reason():
    def f(x, y):
        x.add_(1)
        return x * y

    def g(x):
        x[0] += 1
        return x.sum()

    assert "writes into an argument" in _reason(f, torch.randn(3), torch.randn(3))
    assert "writes into an argument" in _reason(g, torch.randn(3, 2))
    # writing into a tensor made inside is fine
    assert _reason(lambda x: torch.zeros_like(x).add_(x), torch.randn(3)) is None


def test_a_graph_break_is_a_reason():
    def f(x):
        y = x * 2
        print("", end="")
        return y + 1

    assert "graphs" in _reason(f, torch.randn(3))


def test_options():
    with pytest.raises(tfun.errors.ArgumentValueError, match='cuda_graphs must be False, "auto" or True'):
        tfun.jit(rnn, cuda_graphs="yes")
    with pytest.raises(tfun.errors.ArgumentValueError, match="reduce-overhead"):
        tfun.jit(rnn, cuda_graphs=True, mode="reduce-overhead")
    assert tfun.jit(rnn, mode="reduce-overhead", cuda_graphs="auto")._graphs is None  # torch records its own
    assert tfun.jit(rnn, backend="cudagraphs", cuda_graphs="auto")._graphs is None
    assert tfun.jit(rnn, cuda_graphs=False)._graphs is None
    assert tfun.jit(rnn)._graphs is not None  # "auto" by default
    assert tfun.jit(rnn)._graphs.max_graphs == _cuda_graphs.AUTO_MAX_GRAPHS
    assert tfun.jit(rnn, cuda_graphs=True)._graphs.max_graphs == tfun.jit(rnn)._graphs.max_entries
    assert tfun.jit(rnn, cuda_graphs="auto")._graphs is not None
    assert tfun.jit(rnn, backend="aot_eager", cuda_graphs="auto")._graphs is not None


def test_cpu_calls_are_left_alone():
    f = tfun.jit(rnn, backend="aot_eager", cuda_graphs=True)
    args = (torch.randn(3, 3), torch.randn(4, 2, 3), torch.zeros(2, 3))
    for _ in range(3):
        h, ys = f(*args)
    torch.testing.assert_close(ys, rnn(*args)[1])
    assert f.cuda_graph_reasons() == []


def test_result_reasons():
    x = torch.randn(2)
    assert _cuda_graphs._result_reason(x, [x]) is not None  # a CPU result
    assert _cuda_graphs._device_reason([x]) is not None


# ---------------------------------------------------------------------------------------------
# On CUDA: replays compared with eager, over calls with different arguments
# ---------------------------------------------------------------------------------------------


def _data(seed, *shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).cuda() for s in shapes]


@cuda
@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_forward_replays_match_eager_and_are_not_overwritten(backend):
    f = tfun.jit(rnn, backend=backend, cuda_graphs="auto")
    results = []
    with torch.no_grad():
        for seed in range(4):
            W, xs = _data(seed, (8, 8), (37, 4, 8))
            h0 = torch.zeros(4, 8, device="cuda")
            got = f(W / 3, xs, h0)
            want = rnn(W / 3, xs, h0)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            results.append((got, want))
    for got, want in results:  # a later replay does not overwrite an earlier result
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (_, decision), = f.cuda_graph_reasons()
    assert decision == "replayed from a CUDA graph"


@cuda
def test_value_and_grad_inside_is_replayed_with_right_gradients():
    def loss(W, xs, h0):
        return rnn(W, xs, h0)[1].pow(2).mean()

    step = tfun.jit(tfun.value_and_grad(loss), cuda_graphs="auto")
    for seed in range(3):
        W, xs = _data(seed, (8, 8), (29, 4, 8))
        h0 = torch.zeros(4, 8, device="cuda")
        v, g = step(W / 3, xs, h0)
        W64 = (W / 3).double().requires_grad_()
        want = loss(W64, xs.double(), h0.double())
        (want_g,) = torch.autograd.grad(want, W64)
        torch.testing.assert_close(v.double(), want.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(g.double(), want_g, rtol=1e-4, atol=1e-5)
    assert step.cuda_graph_reasons()[0][1] == "replayed from a CUDA graph"


@cuda
def test_results_that_require_grad_run_without_a_graph_and_differentiate():
    f = tfun.jit(lambda W, x: (x @ W).tanh().sum(), cuda_graphs="auto")
    for seed in range(3):
        W, x = _data(seed, (4, 4), (3, 4))
        W.requires_grad_()
        f(W, x).backward()
        W2 = W.detach().clone().requires_grad_()
        (x @ W2).tanh().sum().backward()
        torch.testing.assert_close(W.grad, W2.grad)
    assert "requires grad" in f.cuda_graph_reasons()[0][1]


@cuda
def test_closed_over_tensor_not_recorded_unless_asked():
    W = _data(0, (4, 4))[0]
    f = tfun.jit(lambda x: x @ W, cuda_graphs="auto")
    x = _data(1, (3, 4))[0]
    for _ in range(3):
        torch.testing.assert_close(f(x), x @ W)
    W.mul_(2)  # updated in place: seen either way
    torch.testing.assert_close(f(x), x @ W)
    assert "not an argument" in f.cuda_graph_reasons()[0][1]
    g = tfun.jit(lambda x: x @ W, cuda_graphs=True)
    for _ in range(3):
        torch.testing.assert_close(g(x), x @ W)
    W.mul_(2)
    torch.testing.assert_close(g(x), x @ W)
    assert g.cuda_graph_reasons()[0][1] == "replayed from a CUDA graph"


@cuda
def test_a_host_synchronizing_loop_runs_without_a_graph_or_is_refused():
    def f(x):
        return tfun.lax.while_loop(lambda c: c.norm() > 1.0, lambda c: c * 0.5, x)

    x = _data(0, (16,))[0] * 10
    jf = tfun.jit(f, cuda_graphs="auto")
    for _ in range(3):
        torch.testing.assert_close(jf(x), f(x))
    assert "synchronizes" in jf.cuda_graph_reasons()[0][1]
    strict = tfun.jit(f, cuda_graphs=True)
    strict(x)
    with pytest.raises(JitError, match="synchronizes with the host"):
        strict(x)


@cuda
def test_static_arguments_get_a_graph_each():
    def f(x, n):
        return tfun.lax.fori_loop(0, n, lambda i, c: c * 0.9 + 1.0, x)

    jf = tfun.jit(f, static_argnums=1, cuda_graphs="auto")
    x = _data(0, (5,))[0]
    for n in (3, 7, 3, 7, 3, 7):
        torch.testing.assert_close(jf(x, n), f(x, n))
    assert [d for _, d in jf.cuda_graph_reasons()] == ["replayed from a CUDA graph"] * 2


@cuda
def test_random_numbers_advance_on_each_replay():
    jf = tfun.jit(lambda x: x + torch.rand_like(x), cuda_graphs="auto")
    x = torch.zeros(1000, device="cuda")
    outs = [jf(x) for _ in range(4)]
    assert jf.cuda_graph_reasons()[0][1] == "replayed from a CUDA graph"
    assert not torch.equal(outs[2], outs[3])


def _train_through_functional_call(device, data, rtol=None, atol=None):
    """docs/performance.md's pattern for a module under `cuda_graphs="auto"`: its parameters
    passed detached (sharing the memory the optimizer updates in place between calls) through
    `torch.func.functional_call`, the step `tfun.value_and_grad` inside; five steps, each loss
    and the final parameters compared with the same loop run eagerly. Returns the step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(device)
    reference = __import__("copy").deepcopy(model)

    def loss(params, x, y):
        return (torch.func.functional_call(model, params, (x,)) - y).pow(2).mean()

    step = tfun.jit(tfun.value_and_grad(loss), cuda_graphs="auto")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    for k in range(5):
        x, y = data(k)
        value, grads = step({n: p.detach() for n, p in model.named_parameters()}, x, y)
        for n, p in model.named_parameters():
            p.grad = grads[n]
        opt.step()
        opt_ref.zero_grad()
        want = (reference(x) - y).pow(2).mean()
        want.backward()
        opt_ref.step()
        torch.testing.assert_close(value, want.detach(), rtol=rtol, atol=atol)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)
    return step


@cuda
def test_a_module_trained_through_functional_call_is_replayed_and_trains_as_eager():
    """On CUDA: replayed from the third call on, the same losses and parameters as eager."""
    step = _train_through_functional_call("cuda", lambda k: _data(k, (16, 4), (16, 1)), rtol=1e-5, atol=1e-6)
    assert step.cuda_graph_reasons()[0][1] == "replayed from a CUDA graph"


# ---------------------------------------------------------------------------------------------
# The recording logic on any machine: CPU tensors stand for CUDA ones, and stand-ins for the
# torch.cuda calls record what was asked (a "replay" reruns the captured call into its outputs)
# ---------------------------------------------------------------------------------------------


class _FakeCuda:
    def __init__(self, monkeypatch):
        self.mode = 0
        self.modes_seen = []
        self.captures = 0
        self.replays = 0
        fake = self

        class Stream:
            def __init__(self, device=None):
                pass

            def wait_stream(self, other):
                pass

        class Graph:
            def replay(self):
                # a real replay runs the recorded kernels without Dynamo: here the function runs
                # again, with Dynamo forbidden to recompile, so a replay whose guards no longer
                # hold (a stale graph on a GPU) raises instead of quietly recompiling
                fake.replays += 1
                with torch.compiler.set_stance("fail_on_recompile"):
                    out = self.fn()
                for o, n in zip(tfun.tree.tree_leaves(self.out), tfun.tree.tree_leaves(out)):
                    if isinstance(o, torch.Tensor):
                        o.copy_(n)

        def capture(graph, device, stream, fn):
            fake.captures += 1
            graph.fn = fn
            graph.out = fn()
            return graph.out

        def set_mode(m):
            fake.mode = {"default": 0, "warn": 1, "error": 2}.get(m, m)
            fake.modes_seen.append(fake.mode)
            if fake.mode:  # as torch 2.11 does, after setting it (an error where warnings are)
                warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                              "synchronizing operations", UserWarning, stacklevel=2)

        monkeypatch.setattr(_cuda_graphs, "DEVICE_TYPE", "cpu")
        monkeypatch.setattr(_cuda_graphs, "_capture", capture)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: __import__("contextlib").nullcontext())
        monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: fake.mode)
        monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)


class _AlwaysHolds:
    """A stand-in for Dynamo's guards (`_cuda_graphs.GuardProbe`) that always hold: the
    recording logic alone."""

    def holding(self):
        return ["a guard"]

    def still(self, checks):
        return True


ALWAYS = _AlwaysHolds()


def _cache(required=False):
    return _cuda_graphs.GraphCache(required, "f at here:1", max_entries=2)


def test_recording_logic_copies_in_replays_and_returns_copies(monkeypatch):
    fake = _FakeCuda(monkeypatch)
    cache = _cache()
    calls = []

    def run(x, d):
        calls.append(1)
        return {"y": x * 2 + d["b"], "n": 3}

    lower = lambda: tfun.jit(lambda x, d: x * 2 + d["b"]).lower(x, {"b": b}).graph_modules  # noqa: E731
    outs = []
    for k in range(5):
        x, b = torch.full((3,), float(k)), torch.ones(3)
        out = cache.call((), (x, {"b": b}), {}, run, lower, guards=ALWAYS)
        assert out["n"] == 3
        torch.testing.assert_close(out["y"], x * 2 + 1)
        outs.append((out["y"], x * 2 + 1))
    for got, want in outs:  # each result is the caller's: later replays did not overwrite it
        torch.testing.assert_close(got, want)
    assert fake.captures == 1 and fake.replays == 4  # calls 2 (just recorded) to 5
    assert fake.mode == 0 and 2 in fake.modes_seen  # the check ran in "error" mode and was put back
    (signature, decision), = cache.reasons()
    assert decision == "replayed from a CUDA graph"
    assert signature == "(float32[3] cpu, float32[3] cpu; grad on)"


def test_recording_logic_a_synchronizing_call_is_not_recorded(monkeypatch):
    fake = _FakeCuda(monkeypatch)

    def run(x):
        if fake.mode == 2:
            raise RuntimeError("called a synchronizing CUDA operation")
        return x + 1

    lower = lambda: tfun.jit(lambda x: x + 1).lower(x).graph_modules  # noqa: E731
    cache = _cache()
    x = torch.zeros(2)
    for _ in range(4):
        torch.testing.assert_close(cache.call((), (x,), {}, run, lower, guards=ALWAYS), x + 1)
    assert fake.captures == 0 and fake.mode == 0
    assert "synchronizes with the host (called a synchronizing CUDA operation)" in cache.reasons()[0][1]
    strict = _cache(required=True)
    strict.call((), (x,), {}, run, lower, guards=ALWAYS)
    with pytest.raises(JitError, match="cuda_graphs=True, but a call of `f at here:1` cannot be replayed"):
        strict.call((), (x,), {}, run, lower, guards=ALWAYS)
    assert fake.mode == 0


def test_recording_logic_results_requiring_grad_and_signatures(monkeypatch):
    fake = _FakeCuda(monkeypatch)
    cache = _cache()
    w = torch.ones(2, requires_grad=True)
    run = lambda x: x * w  # noqa: E731
    for _ in range(3):
        cache.call((), (torch.ones(2),), {}, run, lambda: [], guards=ALWAYS)
    assert "requires grad" in cache.reasons()[0][1] and fake.captures == 0
    # a new shape, a new static value: signatures of their own, least recently used dropped
    cache2 = _cache()
    f = lambda x: x + 1  # noqa: E731
    for n in (2, 3, 4):
        for _ in range(2):
            cache2.call((("n", n),), (torch.ones(n),), {}, f, lambda n=n: tfun.jit(f).lower(torch.ones(n)).graph_modules, guards=ALWAYS)
    assert len(cache2.entries) == 2 and fake.captures == 3
    assert [text for text, _ in cache2.reasons()] == [
        "(float32[3] cpu; static n=3; grad on)", "(float32[4] cpu; static n=4; grad on)"
    ]


def test_recording_logic_records_at_most_max_graphs_signatures(monkeypatch):
    # "auto" keeps at most `max_graphs` graphs (each holds its own memory): later signatures
    # run as compiled, with that reason; the recorded ones keep replaying
    fake = _FakeCuda(monkeypatch)
    cache = _cuda_graphs.GraphCache(False, "f at here:1", max_entries=10, max_graphs=2)
    f = lambda x: x + 1  # noqa: E731
    for _ in range(3):
        for n in (2, 3, 4):
            out = cache.call((), (torch.ones(n),), {}, f, lambda n=n: tfun.jit(f).lower(torch.ones(n)).graph_modules, guards=ALWAYS)
            torch.testing.assert_close(out, torch.full((n,), 2.0))
    assert fake.captures == 2 and fake.replays == 4  # n=2 and n=3: recorded on call 2, replayed on call 3
    decisions = [d for _, d in cache.reasons()]
    assert decisions[:2] == ["replayed from a CUDA graph"] * 2
    assert "2 signatures of this function are recorded already" in decisions[2]


def test_recording_logic_large_arguments_are_not_recorded_under_auto(monkeypatch):
    # a graph keeps a copy of its arguments: "auto" leaves calls with large arguments alone
    # (a training step of a large model would hold its parameters twice), True records them
    fake = _FakeCuda(monkeypatch)
    monkeypatch.setattr(_cuda_graphs, "AUTO_MAX_ARGUMENT_BYTES", 64)
    f = lambda x: x + 1  # noqa: E731
    lower = lambda n: (lambda: tfun.jit(f).lower(torch.ones(n)).graph_modules)  # noqa: E731
    cache = _cuda_graphs.GraphCache(False, "f at here:1", max_entries=10)
    for n in (16, 17):  # 64 bytes of float32: recorded; 68: not
        for _ in range(3):
            torch.testing.assert_close(cache.call((), (torch.ones(n),), {}, f, lower(n), guards=ALWAYS), torch.full((n,), 2.0))
    decisions = [d for _, d in cache.reasons()]
    assert decisions[0] == "replayed from a CUDA graph" and fake.captures == 1
    assert "its tensor arguments take 0 MiB, and a graph keeps a copy of them" in decisions[1]
    strict = _cuda_graphs.GraphCache(True, "f at here:1", max_entries=10)
    for _ in range(3):
        strict.call((), (torch.ones(17),), {}, f, lower(17), guards=ALWAYS)
    assert strict.reasons()[0][1] == "replayed from a CUDA graph" and fake.captures == 2


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_recording_logic_through_tfun_jit(backend, monkeypatch):
    """The whole path of a jitted call (compile, inspect the Dynamo graph, check, record,
    replay) with the stand-ins: values, copies, the debug mode put back."""
    fake = _FakeCuda(monkeypatch)
    monkeypatch.setattr(_cuda_graphs, "available", lambda: True)

    def loss(W, xs, h0):
        return rnn(W, xs, h0)[1].pow(2).mean()

    step = tfun.jit(tfun.value_and_grad(loss), backend=backend, cuda_graphs="auto")
    results = []
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        W, xs = torch.randn(5, 5, generator=g) / 3, torch.randn(7, 2, 5, generator=g)
        h0 = torch.zeros(2, 5)
        results.append((step(W, xs, h0), tfun.value_and_grad(loss)(W, xs, h0)))
        assert fake.mode == 0
    for got, want in results:
        torch.testing.assert_close(got, want)
    assert fake.captures == 1 and fake.replays == 3
    assert step.cuda_graph_reasons()[0][1] == "replayed from a CUDA graph"


def test_recording_logic_checks_dynamos_guards_before_each_replay(monkeypatch):
    """A replay runs the recorded kernels without Dynamo. When what Dynamo compiled the call for
    changes (a closed-over Python number, a module's `training` flag), the graph must not be
    replayed (the stand-in's replay raises if it is): the call runs as compiled, Dynamo
    recompiles, and the call is recorded again or refused with the reason; after a second
    such change it is left unrecorded."""
    fake = _FakeCuda(monkeypatch)
    monkeypatch.setattr(_cuda_graphs, "available", lambda: True)
    scale = 2.0
    f = tfun.jit(lambda x: x * scale, backend="aot_eager")
    x = torch.ones(3)
    for _ in range(3):
        torch.testing.assert_close(f(x), x * 2)
    # torch 2.13 bakes the number into the graph (recorded, then replayed); torch 2.11 reads it
    # as an input of the graph, which a replay would bake in, so the call is refused
    recorded = fake.captures
    assert recorded == 1 or "reads a tensor that is not an argument" in f.cuda_graph_reasons()[0][1]
    scale = 3.0  # what a recorded graph multiplies by is now wrong
    for _ in range(3):
        torch.testing.assert_close(f(x), x * 3)
    # Dynamo now reads the number at each call (a float that changed becomes an input of the
    # graph): refused, as above
    assert "not recorded: it reads a tensor that is not an argument" in f.cuda_graph_reasons()[0][1]

    # a parameterless module closed over: its `training` flag is one of Dynamo's guards
    drop = torch.nn.Dropout(0.5)
    g = tfun.jit(lambda x: drop(x), backend="aot_eager")
    ones = torch.ones(64)
    with torch.no_grad():
        for _ in range(3):
            g(ones)
        assert fake.captures == recorded + 1
        drop.eval()
        for _ in range(3):
            torch.testing.assert_close(g(ones), ones)  # no dropout in eval mode
        assert fake.captures == recorded + 2  # recorded again, in eval mode
        drop.train()
        for _ in range(3):
            out = g(ones)
            assert set(out.unique().tolist()) <= {0.0, 2.0}
        (_, decision), = g.cuda_graph_reasons()
        assert "changed after it was recorded, twice" in decision and fake.captures == recorded + 2


def test_recording_logic_without_dynamos_guards_records_nothing(monkeypatch):
    # a torch that does not expose Dynamo's guards: nothing is recorded, and the reason says why
    fake = _FakeCuda(monkeypatch)
    monkeypatch.setattr(_cuda_graphs, "available", lambda: True)
    monkeypatch.setattr(_compat, "dynamo_guards", lambda compiled: None)
    f = tfun.jit(lambda x: x + 1, backend="aot_eager")
    for _ in range(3):
        torch.testing.assert_close(f(torch.ones(2)), torch.full((2,), 2.0))
    assert fake.captures == 0
    assert "does not let tfun check Dynamo's guards" in f.cuda_graph_reasons()[0][1]


def test_dynamos_guards_are_found_and_checked_on_this_torch():
    # the feature the replays depend on, on the installed torch: the guards of a tfun.jit
    # function's compiled graphs, checked against a frame built from the call's arguments
    scale = 2.0
    f = tfun.jit(lambda x, n=1: x * scale * n, backend="aot_eager")
    f(torch.ones(2))
    probe = _cuda_graphs.GuardProbe(f._plain, (torch.ones(2),), {})
    held = probe.holding()
    assert held and probe.still(held)
    assert not _cuda_graphs.GuardProbe(f._plain, (torch.ones(5, 5),), {}).still(held)  # another shape
    scale = 3.0
    assert not probe.still(held)
    h = tfun.jit(lambda x, n: x * n, static_argnums=1, backend="aot_eager")
    h(torch.ones(2), 3)
    compiled, a, k = h._runner((torch.ones(2), 3), {})
    probe = _cuda_graphs.GuardProbe(compiled, a, k)
    assert probe.holding() and probe.still(probe.holding())


def test_recording_logic_a_module_trained_through_functional_call(monkeypatch):
    """The same pattern with the stand-ins: recorded once and replayed, it trains exactly as
    the same loop run eagerly."""
    fake = _FakeCuda(monkeypatch)
    monkeypatch.setattr(_cuda_graphs, "available", lambda: True)

    def data(k):
        g = torch.Generator().manual_seed(k)
        return torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)

    step = _train_through_functional_call("cpu", data)
    assert fake.captures == 1 and fake.replays == 4  # the second call records, then replays; 3-5 replay
    assert step.cuda_graph_reasons()[0][1] == "replayed from a CUDA graph"
