"""How a codec's arithmetic runs: `@kernel` compiles it with torch.compile (C++ on CPU, Triton on GPU)
where a compiler is present, or runs it eagerly.

The codecs' maths is integer arithmetic, one float multiply per value and exact comparisons, so
compiled and eager give the same bits, and a call may take either path. So a kernel's first calls
run eagerly while one background thread compiles it (`compile_mode`): a job's first steps pay no
compile stall of seconds, only the eager path's cost until the compile is done.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import shutil
import threading
import time
import types
import warnings

import torch

COMPILE_MODES = ("auto", "1", "0")
# INT_LOADS: inductor's C++ (torch 2.13, AVX2) loads an integer vector through a scalar copy, 3-5x slower
# than a float load, so kernels take integer arrays as float bits (or floats) and convert inside.
# Inductor stores a value that has two users and reads more than 4 inputs (realize_reads_threshold), then
# reads it back in a second loop: a per-row pick reads 5-6 tables, so that split kernels in two (and the
# read-back of int32 hits INT_LOADS). Recomputing is cheaper where it split: encode + decode at 4M elements,
# 2 workers, 1 thread, two A B A B runs (bench/results/codec_ab_realize.md and its previous version): packed
# int64 words 1.20x and 1.28x faster, gqsgd-exp 1.38x and 1.16x; int8 gqsgd 0.92x and 1.08x (no effect shown).
COMPILE_OPTIONS = {"realize_reads_threshold": 64}
# On CPU a background compile takes seconds of the cores and of the GIL the step runs on (3 workers on 2
# cores at 1 Gbit/s: 16 steps at 0.2-0.4 s against 0.14 s), so a variant is compiled only once its eager calls
# take this share of the time since its first call (from its HOT_CALLS-th call on): it is hot, and a compile
# pays. At 1.7M elements, 1 thread (eager vs compiled, ms): gqsgd's packing (41 vs 3.5 per 1M) called every
# step takes a third of a 0.14 s step and compiles at its third call; the header's max |g| (5.1 vs 0.71),
# called at steps 0 and 1 and then once per 10 steps where no codec needs scales, takes 1-2% and stays eager;
# so do the bf16 cast (0.99 vs 0.51) and low rank's small factor codes. `compile_ahead` compiles at once; on
# CUDA every variant does.
COMPILE_SHARE = 0.05
HOT_CALLS = 3


def compile_mode(device: torch.device) -> str:
    """How kernels run on ``device``: "eager"; "now" (compile on the first call, which waits for it:
    NETGAIN_COMPILE=1, and `compile_now()`); "background" (NETGAIN_COMPILE=auto where a compiler exists:
    the first calls run eagerly while a thread compiles, so no step waits seconds for a compile)."""
    mode = os.environ.get("NETGAIN_COMPILE", "auto")
    if mode not in COMPILE_MODES:
        raise ValueError(f"NETGAIN_COMPILE={mode!r} is not one of {COMPILE_MODES}")
    if mode == "0" or (mode == "auto" and not _compiler_present(device.type)):
        return "eager"
    return "now" if mode == "1" or getattr(_local, "now", False) else "background"


@contextlib.contextmanager
def compile_ahead():
    """Kernels first called inside start compiling in the background at once, however cold: a caller that
    will soon run them hot (auto warming a plan before its trial) pays no eager steps for their heat to show."""
    before, _local.ahead = getattr(_local, "ahead", False), True
    try:
        yield
    finally:
        _local.ahead = before


@contextlib.contextmanager
def cold(on: bool = True):
    """Kernels called inside (with ``on``) begin no compile and gain no heat: they run eagerly, or compiled where an
    earlier caller's compile is done. A codec that runs only a step or two (a planner's unplanned codec, under FSDP
    called once per group, hot at its third call) would only begin a compile that takes the cores its steps need,
    and a planner takes no link samples beside a compile."""
    before = getattr(_local, "cold", False)
    _local.cold = before or on
    try:
        yield
    finally:
        _local.cold = before


def is_cold() -> bool:
    """Whether this thread runs inside `cold`: a caller whose work finishes on another thread (a collective's
    callback decodes there) carries it over."""
    return getattr(_local, "cold", False)


@contextlib.contextmanager
def compile_now():
    """Kernels first called inside compile here and now (on this thread): what a timing of the compiled
    path (time_codec, a codec's calibration) must run, not the eager path that serves while compiling."""
    before, _local.now = getattr(_local, "now", False), True
    try:
        yield
    finally:
        _local.now = before


@functools.cache
def _compiler_present(device_type: str) -> bool:
    """Triton for CUDA, a C compiler for CPU. Looked up once: every kernel call asks, and searching the
    PATH for four compilers took 47-72 us a call against 2-4 us cached (5 alternating timings of 2,000
    calls each; low rank makes 24 kernel calls a step)."""
    if device_type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True
    return device_type == "cpu" and any(shutil.which(cc) for cc in ("cc", "gcc", "g++", "clang"))


_local = threading.local()
_KERNEL_CACHES: list[dict] = []  # every kernel's compiled variants
_compiles: queue.SimpleQueue = queue.SimpleQueue()  # (variant, args, kwargs) for the compile thread
_compile_thread: threading.Thread | None = None
_compile_lock = threading.Lock()


def compiled_kernels() -> int:
    """How many kernel variants this process has begun compiling."""
    return sum(isinstance(variant, _Variant) for cache in _KERNEL_CACHES for variant in cache.values())


def compiling() -> bool:
    """A compile is in flight: kernels run eagerly meanwhile, so a step now is no steady-state step."""
    return any(not variant.ready.is_set() for cache in list(_KERNEL_CACHES) for variant in list(cache.values()))


def wait_for_compiles() -> None:
    """Return once every compile begun so far has finished (benchmarks and tests of the compiled path)."""
    for cache in list(_KERNEL_CACHES):
        for variant in list(cache.values()):
            variant.ready.wait()


class _Variant:
    """One graph of a kernel, compiled for one class of arguments; its calls run eagerly until it is ready."""

    def __init__(self, fn, options):
        self.fn, self.options = fn, options
        self.compiled = None  # torch.compile's wrapper, made where it compiles (its first use imports inductor: seconds)
        self.ready = threading.Event()
        self.failed = False

    def wrap(self) -> None:
        _untraced_shared_graphs()
        self.compiled = torch.compile(_own_code(self.fn), dynamic=True, options=self.options)

    def build(self, args, kwargs, threads: int) -> None:
        """Compile by running on these arguments (copies of a real call's), on the compile thread, at the
        caller's thread count (inductor's C++ bakes it in)."""
        torch.set_num_threads(threads)
        try:
            self.wrap()
            if any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
                torch.cuda.synchronize()  # the copies were made on the caller's stream
            self.compiled(*args, **kwargs)
        except Exception as error:  # the eager path serves on; say why once
            self.failed = True
            warnings.warn(f"netgain: compiling a codec kernel failed ({type(error).__name__}: {error}); "
                          "it runs eagerly", RuntimeWarning)
        finally:
            self.ready.set()


def _compile_in_background(variant: _Variant, args, kwargs) -> None:
    global _compile_thread
    copies = tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
    _compiles.put((variant, copies, kwargs, torch.get_num_threads()))
    with _compile_lock:
        if _compile_thread is None:  # a daemon: a run that ends never waits for a compile it no longer needs
            _compile_thread = threading.Thread(target=_compile_loop, name="netgain-compile", daemon=True)
            _compile_thread.start()


def _compile_loop() -> None:
    """Compile at the lowest CPU priority (nice 19: Linux's nice is per thread, and the compiler processes it
    starts inherit it): on a CPU host with few cores the compile takes what the step leaves idle, such as
    its waits on the link, instead of slowing the steps it was meant not to stall."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: compile at the process's priority
        pass
    _keep_sessions_to_this_thread()
    while True:
        variant, args, kwargs, threads = _compiles.get()
        variant.build(args, kwargs, threads)


@functools.cache
def _untraced_shared_graphs() -> None:
    """Inductor builds one graph per process at its first lowering by torch.fx.symbolic_trace (InterpreterShim's
    dummy, an identity), and symbolic_trace patches torch.nn.Module.__call__ for every thread while it runs: a
    module called on another thread meanwhile raised NameError ("module is not installed as a submodule"). 2 of 4
    HSDP ranks failed so in their first forward on a cold cache; building it first on the caller's thread was not
    enough, since the caller may be a collective's callback thread while the user's thread runs a forward. So the
    same graph is built here by hand, which patches nothing, before any compile."""
    try:
        from torch._inductor.loop_body import InterpreterShim
    except ImportError:  # another torch: nothing of this name to replace
        return
    if not hasattr(InterpreterShim, "_dummy_gm"):
        return
    graph = torch.fx.Graph()
    graph.output(graph.placeholder("x"))
    identity = torch.fx.GraphModule(torch.nn.Module(), graph)
    InterpreterShim._dummy_gm = staticmethod(lambda: identity)


def _keep_sessions_to_this_thread() -> None:
    """Dynamo holds torch.compiler.is_compiling() true for a whole compile session, in a process-wide flag, so
    while this thread compiled, every other thread saw it true: PyTorch's fp16_compress_hook then returned a
    tensor where DDP wants a future, optimizers skip their checks, transformers takes its traced branches.
    Sessions begun on this thread leave the flag alone (the codecs' kernels read no flag and have no tensor
    subclass whose dispatch would); every other thread's session sets it as before."""
    session = getattr(torch.compiler, "_compile_session_context", None)
    if session is None or getattr(session, "netgain_thread", None) is not None:
        return
    compile_thread = threading.current_thread()

    @contextlib.contextmanager
    def thread_session():
        if threading.current_thread() is compile_thread:
            yield
        else:
            with session():
                yield

    thread_session.netgain_thread = compile_thread
    torch.compiler._compile_session_context = thread_session


def _argument_class(args) -> tuple:
    """What a dynamic-shape graph is specialised on: for tensors, dtype, rank, contiguity and which sizes are
    0 or 1 (torch.compile specialises those); integers likewise (0, 1 or any other: one graph serves every
    bit width); other values as they are (floats are specialised). A call of another class would recompile
    inside the call, so it gets a graph of its own, compiled in the background. Left out on purpose: which
    sizes are equal (a graph traced with two equal sizes guards on it), so that classes stay few; a call
    that breaks such a guard recompiles inside the call, as without this module."""
    return tuple((a.dtype, a.dim(), tuple(min(n, 2) for n in a.shape), a.is_contiguous())
                 if isinstance(a, torch.Tensor) else min(a, 2) if type(a) is int and a >= 0 else a for a in args)


def kernel(fn=None, *, options=COMPILE_OPTIONS, variant=None):
    """fn compiled (dynamic shapes: one compile serves every bucket size) or eager, chosen per device
    (compile_mode); ``options``: inductor's, for this kernel (``@kernel(options=...)``); ``variant``: for a
    kernel whose graph changes with its arguments (a loop unrolled over a dimension), a function of the
    arguments naming the graph. Each variant compiles its own copy of fn: dynamo counts recompiles per code
    object and runs a function eagerly once it has 8 graphs, which gqsgd's 7 bit widths x 2 word halves
    reached, so that after a Kimad plan had visited other widths the 8-bit packing ran eagerly. Eager and
    compiled give the same bits, so a call may take either path."""
    if fn is None:
        return functools.partial(kernel, options=options, variant=variant)
    compiled: dict[tuple, _Variant] = {}
    _KERNEL_CACHES.append(compiled)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        mode = compile_mode(args[0].device)
        if mode == "eager":
            return fn(*args, **kwargs)
        ahead = getattr(_local, "ahead", False)  # compiles at once, also inside `cold` (a plan warmed meanwhile)
        key = (variant(*args, **kwargs) if variant else None, _argument_class(args))
        graph = compiled.get(key)
        if is_cold() and not ahead:  # begins no compile and gains no heat, but a graph compiled already serves
            return _call(graph, fn, args, kwargs)
        if graph is None or isinstance(graph, _Eager):
            if mode == "background" and not args[0].is_cuda and not ahead:
                start = time.perf_counter()  # compile only what pays: time the eager calls
                result = fn(*args, **kwargs)
                graph = graph or compiled.setdefault(key, _Eager(start))
                if graph.hot(start, time.perf_counter()):
                    compiled[key] = hot = _Variant(fn, options)
                    _compile_in_background(hot, args, kwargs)
                return result
            graph = compiled[key] = _Variant(fn, options)
            if mode == "now":
                graph.wrap()  # torch.compile compiles on this first call
                graph.ready.set()
            else:
                _compile_in_background(graph, args, kwargs)
        elif mode == "now":
            graph.ready.wait()  # begun in the background: this caller wants the compiled path
        return _call(graph, fn, args, kwargs)

    run.eager = fn
    return run


def _call(graph, fn, args, kwargs):
    """``graph``'s compiled path where it is ready (the same bits as ``fn``'s), else ``fn`` eagerly: a graph compiled
    for one caller serves every other, also one inside `cold` (eager, the route's 4-bit average of 1.78 M parameters
    took 0.07-0.35 s in a process against 0.003 compiled, one thread)."""
    if graph is not None and graph.ready.is_set() and not graph.failed and not _fx_tracing():
        try:
            return graph.compiled(*args, **kwargs)
        except RuntimeError:
            if not _fx_tracing():
                raise
    return fn(*args, **kwargs)


def _fx_tracing() -> bool:
    """Whether some thread is FX-tracing now (a process-wide flag): the compile thread's AOT and inductor traces set
    it, and dynamo then refuses any compiled call on another thread ("Detected that you are using FX to symbolically
    trace a dynamo-optimized function": 3 ranks of the lab at 1 Gbit/s died so in their first backward). Kernels run
    eagerly meanwhile, with the same bits; a call that began compiled and was refused as the flag rose runs again."""
    return torch.fx._symbolic_trace.is_fx_symbolic_tracing()


class _Eager:
    """A CPU variant running eagerly until its calls take COMPILE_SHARE of the time since its first."""
    ready, failed = threading.Event(), True
    ready.set()

    def __init__(self, first: float):
        self.first, self.spent, self.calls = first, 0.0, 0

    def hot(self, start: float, end: float) -> bool:
        self.spent += end - start
        self.calls += 1
        return self.calls >= HOT_CALLS and self.spent >= COMPILE_SHARE * (end - self.first)


def _own_code(fn):
    """fn with a code object of its own, which dynamo caches and counts apart from fn's."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__qualname__, copy.__kwdefaults__ = fn.__qualname__, fn.__kwdefaults__
    return copy
