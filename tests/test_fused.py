"""The fused bucket codecs: compiled (torch.compile, C++ on this CPU) and eager give the same codes
bit for bit for every codec, the counter-based noise is a pure function of its keys and is
independent of the bucket layout, and the segmented max matches a per-parameter loop."""

import itertools
import threading
import time

import pytest
import torch

import netgain.comm as comm
from netgain.comm import fused, kernel
from netgain.comm import quantize as Q
from netgain.comm.codecs import Context
from netgain.comm.feedback import EF21
from netgain.comm.fused import Segments

from compiles import compile_every_call, record_compiles

SIZES = [3000, 1, 17, 2048, 5000, 999]  # parameters of a bucket: tiny ones, block-aligned ones, odd ones
FACTOR_SIZES = [300] * 30 + [5]  # a low-rank factor payload's columns
CODECS = [("none", {}), ("fp16", {}), ("bf16", {}), ("qsgd", {"bits": 6}), ("gqsgd", {"bits": 8, "encoding": "int8"}),
          ("gqsgd", {"bits": 8}), ("gqsgd", {"bits": 3}), ("gqsgd-exp", {"bits": 8}), ("topk", {"ratio": 0.05}),
          ("randomk", {"ratio": 0.05})]


def bucket(seed=0, sizes=SIZES):
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(n, generator=g) * (i + 1) for i, n in enumerate(sizes)])


def segments(order=None, sizes=SIZES):
    order = order or list(range(len(sizes)))
    return Segments.build([sizes[i] for i in order], [fused.name_key(f"p{i}") for i in order], "cpu")


def noise(s, keys):
    """Every element's noise, counted by its index inside its parameter."""
    return fused.noise_at(torch.arange(s.numel, dtype=torch.int32), s.seg.long(), s.starts, keys)


def round_trip(name, params, world_size=3, sizes=SIZES):
    """One encode + decode of a fixed bucket, faking the collective as world_size identical ranks."""
    codec = comm.make_codec(name, **params)
    s = segments(sizes=sizes)
    x = bucket(sizes=sizes)
    ctx = Context.for_step(world_size, s, 1, 5, 0, feedback=EF21(x.numel()) if codec.uses_feedback else None)
    ctx.scales = codec.local_scales(x, ctx)
    payload = codec.encode(x.clone(), ctx).clone()
    if codec.collective == "allreduce":
        aggregated = payload * world_size
    elif codec.collective == "allgather":
        aggregated = payload.expand(world_size, *payload.shape).contiguous()
    else:
        aggregated = payload
    out = codec.decode(aggregated, torch.empty_like(x), ctx)
    return payload, out


# SIZES' bucket has 10 rows: packed words in rows, or (at the default MIN_PACKED_ROWS) side words only; FACTOR_SIZES'
# rows mostly cut three or more parameters, so it has no rows for any codec (low rank's factor payloads)
@pytest.mark.parametrize("sizes,min_rows", [(SIZES, 0), (SIZES, fused.MIN_PACKED_ROWS), (FACTOR_SIZES, 0)],
                         ids=["rows", "packed-side", "no-rows"])
@pytest.mark.parametrize("name,params", CODECS, ids=[f"{n}{p}" for n, p in CODECS])
def test_compiled_and_eager_codes_are_identical(name, params, sizes, min_rows, monkeypatch):
    monkeypatch.setattr(fused, "MIN_PACKED_ROWS", min_rows)
    monkeypatch.setenv("NETGAIN_COMPILE", "0")
    eager = round_trip(name, params, sizes=sizes)
    monkeypatch.setenv("NETGAIN_COMPILE", "1")
    compiled = round_trip(name, params, sizes=sizes)
    assert torch.equal(eager[0], compiled[0]), "payloads differ"
    assert torch.equal(eager[1], compiled[1]), "decoded buckets differ"


def test_noise_is_a_pure_function_of_keys_and_independent_of_the_layout():
    forward, backward = segments(), segments(list(reversed(range(len(SIZES)))))
    keys_f, keys_b = fused.step_keys(forward.keys, 3, 7, 1), fused.step_keys(backward.keys, 3, 7, 1)
    noise_f = noise(forward, keys_f)
    noise_b = noise(backward, keys_b)
    parts_f = dict(zip(range(len(SIZES)), noise_f.split(SIZES)))
    parts_b = dict(zip(reversed(range(len(SIZES))), noise_b.split(list(reversed(SIZES)))))
    assert all(torch.equal(parts_f[i], parts_b[i]) for i in range(len(SIZES)))  # each parameter's own noise
    again = noise(forward, fused.step_keys(forward.keys, 3, 7, 1))
    assert torch.equal(noise_f, again)
    other_rank = noise(forward, fused.step_keys(forward.keys, 3, 7, 2))
    assert (noise_f != other_rank).float().mean() > 0.99
    assert 0 <= float(noise_f.min()) and float(noise_f.max()) < 1 and abs(float(noise_f.mean()) - 0.5) < 0.01


def test_stochastic_rounding_is_unbiased():
    s = Segments.build([200_000], [fused.name_key("w")], "cpu")
    x = torch.full((200_000,), 2.3)
    codes = fused.round_int8(x, s, torch.ones(1), fused.step_keys(s.keys, 0, 0, 0), 127,
                             torch.empty(x.numel(), dtype=torch.int8)).float()
    assert set(codes.unique().tolist()) == {2.0, 3.0}
    assert abs(codes.mean().item() - 2.3) < 3 * 0.46 / 200_000 ** 0.5


def test_segmented_max_matches_a_loop_and_flags_nonfinite():
    s, x = segments(), bucket()
    expected = torch.stack([part.abs().max() for part in x.split(SIZES)])
    assert torch.equal(s.absmax(x), expected)
    x[3000 + 1 + 5] = float("nan")  # inside the third parameter
    assert torch.isnan(s.absmax(x)).tolist() == [False, False, True, False, False, False]


@pytest.mark.parametrize("compiled", ["0", "1"])
@pytest.mark.parametrize("sizes", [[5000], [1024, 1024, 7], [700, 700, 700, 3000], [1, 2, 3, 4096, 5, 2500, 1023],
                                   FACTOR_SIZES],  # most rows cut three or more: no rows, every element alone
                         ids=lambda sizes: "-".join(map(str, sizes)))
def test_rows_equal_the_per_element_path(sizes, compiled, monkeypatch):
    """Row tables (<= 2 parameters a row) and fix elements give what every element computed alone gives."""
    monkeypatch.setenv("NETGAIN_COMPILE", compiled)
    monkeypatch.setattr(fused, "MIN_PACKED_ROWS", 0)  # packed rows in these small buckets too
    s = Segments.build(sizes, [fused.name_key(f"p{i}") for i in range(len(sizes))], "cpu")
    x = torch.randn(s.numel, generator=torch.Generator().manual_seed(1)) * 3
    multiplier, keys = torch.rand(len(sizes)) * 40 + 1, fused.step_keys(s.keys, 2, 3, 1)
    index, seg = torch.arange(s.numel), s.seg.long()
    expected = fused._round_elements.eager(x, index, seg, s.starts, multiplier, keys, 127)
    assert s.rows == (0 if len(sizes) > 10 else s.numel // fused.ROW)
    assert torch.equal(fused.round_int8(x, s, multiplier, keys, 127, torch.empty_like(expected)), expected)
    assert torch.equal(fused.scale_into(torch.empty_like(x), expected, s, multiplier), expected.float() * multiplier[seg])
    assert torch.equal(s.absmax(x), torch.stack([part.abs().max() for part in x.split(sizes)]))
    layouts = [fused.Words(torch.int32, 10, 3, 127), fused.Words(torch.int64, 15, 4, 127),
               fused.Words(torch.int32, 8, 4, 0)]  # planar fields cut rows at other places; int8's signed bytes
    for layout, min_packed_rows in itertools.product(layouts, (0, s.rows + 1)):  # row words, or side words only
        monkeypatch.setattr(fused, "MIN_PACKED_ROWS", min_packed_rows)
        words = fused.round_pack(x, s, multiplier, keys, 127, layout,
                                 torch.empty(layout.count(s.numel), dtype=layout.dtype))
        decoded = fused.unpack_scale_into(torch.empty_like(x), words, s, multiplier, layout, 1)
        assert torch.equal(decoded, expected.float() * multiplier[seg])
    scales = x.abs().max() * (torch.rand(len(sizes)) + 0.5)  # some elements above their scale: saturation
    for exponents in (127, 3):
        exp_codes = Q.exp_encode(x / scales[seg], 3, exponents, noise(s, keys))
        assert torch.equal(fused.exp_encode(x, s, scales, keys, 3, exponents, torch.empty_like(expected)), exp_codes)
    local, threshold = torch.randn(s.numel, generator=torch.Generator().manual_seed(2)), torch.rand(len(sizes)) * 4
    flags = fused.at_or_above(x, local, s, threshold, torch.empty(s.numel, dtype=torch.int8))
    assert torch.equal(flags.bool(), (x - local).abs() >= threshold[seg])


@pytest.mark.parametrize("numel", [0, 7, 64, 4099])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0])
def test_flag_indices_are_nonzero_of_the_flags(numel, density):
    flags = (torch.rand(numel, generator=torch.Generator().manual_seed(numel)) < density).to(torch.int8)
    assert torch.equal(fused.flag_indices(flags), flags.nonzero().squeeze(1))


def test_exponential_ring_hop_is_identical_compiled_and_eager(monkeypatch):
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randint(-127, 128, (4099,), generator=g, dtype=torch.int8) for _ in range(2))
    key = torch.tensor(12345, dtype=torch.int32)
    monkeypatch.setenv("NETGAIN_COMPILE", "1")
    compiled = fused.exp_combine(a, b, key, 3, 127, torch.empty(2 * 4099))
    monkeypatch.setenv("NETGAIN_COMPILE", "0")
    assert torch.equal(compiled, fused.exp_combine(a, b, key, 3, 127, torch.empty(2 * 4099)))


def test_every_bit_width_packs_compiled(monkeypatch):
    """Each word layout is its own graph of the packing kernel; dynamo's recompile limit counts per
    graph, so a plan that visits many widths never leaves one of them running eagerly."""
    import logging

    monkeypatch.setenv("NETGAIN_COMPILE", "1")
    limit = torch._dynamo.config.patch(recompile_limit=1)  # monkeypatch's undo leaves dynamo's config broken
    monkeypatch.setattr(fused, "MIN_PACKED_ROWS", 0)
    limits = []

    class Catch(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            limits.extend(["recompile_limit" in message and "_round_pack_rows" in message])

    handler = Catch()
    logging.getLogger("torch._dynamo").addHandler(handler)
    limit.__enter__()
    try:
        sizes = [4096, 4096]
        s = Segments.build(sizes, [fused.name_key(f"w{i}") for i in range(len(sizes))], "cpu")
        x, multiplier, keys = torch.randn(s.numel), torch.rand(2) * 40 + 1, fused.step_keys(s.keys, 2, 3, 1)
        # layouts no codec produces: no other test compiled these graphs at another size
        for layout, levels in ((fused.Words(torch.int32, 9, 3, 100), 100), (fused.Words(torch.int32, 7, 4, 50), 50)):
            words = fused.round_pack(x, s, multiplier, keys, levels, layout,
                                     torch.empty(layout.count(s.numel), dtype=layout.dtype))
            expected = fused._round_elements.eager(x, torch.arange(s.numel), s.seg.long(), s.starts, multiplier, keys,
                                                   levels)
            decoded = fused.unpack_scale_into(torch.empty_like(x), words, s, multiplier, layout, 1)
            assert torch.equal(decoded, expected.float() * multiplier[s.seg.long()])
    finally:
        limit.__exit__(None, None, None)
        logging.getLogger("torch._dynamo").removeHandler(handler)
    assert not any(limits)


@pytest.fixture
def compile_jobs(monkeypatch):
    """The compile thread's queue, taken here: the test builds what it likes. Graphs begun in the test are
    dropped afterwards, so no later caller waits for a compile that never ran."""
    compile_every_call(monkeypatch.setattr, monkeypatch.setenv)
    jobs = record_compiles(monkeypatch.setattr)
    before = [dict(cache) for cache in kernel._KERNEL_CACHES]
    yield jobs
    for cache, kept in zip(kernel._KERNEL_CACHES, before):
        cache.clear()
        cache.update(kept)


def test_first_calls_run_eagerly_while_the_compile_thread_works(compile_jobs):
    """A kernel's first call starts its compile on copies of the arguments and runs eagerly, with the
    same bits; once the compile is done, calls take the compiled graph. The user's tensors are never the
    compile's."""
    x, out = torch.randn(3000), torch.zeros(3000, dtype=torch.float16)
    expected = fused.cast_scaled.eager(torch.empty_like(out), x, 0.3125)

    assert torch.equal(fused.cast_scaled(out, x, 0.3125), expected)  # eager, while compiling
    (graph, args, kwargs, threads), = compile_jobs
    assert not graph.ready.is_set() and args[0] is not out and torch.equal(args[1], x) and args[1] is not x
    assert kernel.compiling()
    graph.build(args, kwargs, threads)
    assert graph.ready.is_set() and not graph.failed and not kernel.compiling()
    calls = []
    compiled = graph.compiled
    graph.compiled = lambda *a, **k: calls.append(1) or compiled(*a, **k)
    out.zero_()
    assert torch.equal(fused.cast_scaled(out, x, 0.3125), expected) and calls == [1]  # compiled, same bits
    assert len(compile_jobs) == 1  # the same class of arguments: no second compile


def test_a_new_class_of_arguments_compiles_its_own_graph(compile_jobs):
    """Sizes 0 and 1, dtypes and other arguments' values are what a graph is specialised on: a call that
    differs in them would recompile inside the compiled call (a stall), so it starts a graph of its own."""
    for numel, scale in ((3000, 0.25), (5000, 0.25), (1, 0.25), (3000, 0.5)):
        fused.cast_scaled(torch.zeros(numel, dtype=torch.float16), torch.randn(numel), scale)
    assert len(compile_jobs) == 3  # 5000 elements share 3000's graph; 1 element and another scale do not


def test_a_kernel_compiles_once_hot_or_when_asked_ahead(compile_jobs, monkeypatch):
    """On CPU a background compile takes the step's cores and the GIL: a variant is compiled only from its
    HOT_CALLS-th call, once its eager calls take COMPILE_SHARE of the time since its first; one called rarely
    stays eager. `compile_ahead` starts the compile at the first call."""
    monkeypatch.setattr(kernel, "HOT_CALLS", 3)
    monkeypatch.setattr(kernel, "COMPILE_SHARE", 0.05)
    x = torch.randn(3000)
    expected = fused.cast_scaled.eager(torch.empty(3000, dtype=torch.float16), x, 0.25)
    for call in range(3):  # back to back: hot at the third call
        assert torch.equal(fused.cast_scaled(torch.empty(3000, dtype=torch.float16), x, 0.25), expected)
        assert len(compile_jobs) == (call == 2)
    for call in range(3):  # another class, called once in a long while: cold
        fused.cast_scaled(torch.empty(3000, dtype=torch.float16), x, 0.5)
        time.sleep(0.05)
    assert len(compile_jobs) == 1
    with kernel.compile_ahead():
        fused.cast_scaled(torch.empty(3000, dtype=torch.float16), x, 0.75)
    assert len(compile_jobs) == 2


def test_kernels_called_cold_run_eagerly_and_gain_no_heat(compile_jobs):
    """Inside `cold` (a planner's unplanned codec) a kernel runs eagerly and never begins a compile, however often
    it is called; `compile_ahead` inside it still compiles (a plan warmed meanwhile); outside, the heat starts from 0."""
    x = torch.randn(3000)
    with kernel.cold():
        for _ in range(5):
            fused.cast_scaled(torch.empty(3000, dtype=torch.float16), x, 0.25)
        assert not compile_jobs
        with kernel.compile_ahead():
            fused.cast_scaled(torch.empty(3000, dtype=torch.float16), x, 0.5)
        assert len(compile_jobs) == 1
    with kernel.cold(False):
        fused.cast_scaled(torch.empty(3000, dtype=torch.float16), x, 0.25)
    assert len(compile_jobs) == 2


def test_a_graph_compiled_already_serves_calls_inside_cold(compile_jobs):
    """`cold` begins no compile, but where an earlier caller's compile is done its graph serves (the same bits):
    the route's eager average of 1.78 M parameters took 0.07-0.35 s against 0.003 compiled."""
    x = torch.randn(3000)
    expected = fused.cast_scaled.eager(torch.empty(3000, dtype=torch.float16), x, 0.25)
    with kernel.compile_ahead():
        fused.cast_scaled(torch.empty(3000, dtype=torch.float16), x, 0.25)
    (graph, args, kwargs, threads), = compile_jobs
    with kernel.cold():  # still compiling: eager
        assert torch.equal(fused.cast_scaled(torch.empty(3000, dtype=torch.float16), x, 0.25), expected)
    graph.build(args, kwargs, threads)
    calls, compiled = [], graph.compiled
    graph.compiled = lambda *a, **k: calls.append(1) or compiled(*a, **k)
    with kernel.cold():
        assert torch.equal(fused.cast_scaled(torch.empty(3000, dtype=torch.float16), x, 0.25), expected)
        fused.cast_scaled(torch.empty(3000, dtype=torch.float16), x, 0.5)  # another class: eager, no compile
    assert calls == [1] and len(compile_jobs) == 1


def test_background_compile_ends_in_the_compiled_path(monkeypatch):
    """The real compile thread: a run's later calls take compiled code, bit-identical to eager."""
    compile_every_call(monkeypatch.setattr, monkeypatch.setenv)
    x = torch.randn(4099)
    expected = fused.cast_scaled.eager(torch.empty(4099, dtype=torch.bfloat16), x, 0.1875)
    first = fused.cast_scaled(torch.empty(4099, dtype=torch.bfloat16), x, 0.1875)
    kernel.wait_for_compiles()
    assert not kernel.compiling()
    assert torch.equal(first, expected)
    assert torch.equal(fused.cast_scaled(torch.empty(4099, dtype=torch.bfloat16), x, 0.1875), expected)


def test_background_compile_leaves_other_threads_not_compiling(monkeypatch):
    """While the compile thread compiles, torch.compiler.is_compiling() stays false on every other thread
    (dynamo's flag is process-wide: PyTorch's fp16_compress_hook returned a tensor to DDP while it was set)."""
    compile_every_call(monkeypatch.setattr, monkeypatch.setenv)

    @kernel.kernel
    def scaled_sum(x, factor: float):
        return (x * factor).sum()

    scaled_sum(torch.randn(5003), 0.5)
    seen = []
    while kernel.compiling():
        seen.append(torch.compiler.is_compiling())
    assert len(seen) > 0 and not any(seen)
    assert torch.compiler.is_compiling() is False


def test_a_background_compile_patches_no_module_call_of_other_threads(monkeypatch, tmp_path):
    """inductor's first lowering in a process built a dummy graph with torch.fx.symbolic_trace, which patches
    torch.nn.Module.__call__ for every thread while it runs: a module called meanwhile on another thread raised
    NameError, also where the compile began on a callback's thread. netgain builds that graph by hand instead."""
    from torch._inductor.loop_body import InterpreterShim

    compile_every_call(monkeypatch.setattr, monkeypatch.setenv)
    monkeypatch.setattr(kernel, "_compile_thread", None)
    monkeypatch.setattr(InterpreterShim, "_dummy_gm", staticmethod(lambda: torch.fx.symbolic_trace(lambda x: x)))
    kernel._untraced_shared_graphs.cache_clear()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # lowers, as on a cold cache
    traces = []  # per trace: whether its tracer patches module calls as the base Tracer does (NameError elsewhere)
    trace = torch.fx.Tracer.trace

    def recorded(tracer, root, concrete_args=None):
        traces.append(type(tracer).call_module is torch.fx.Tracer.call_module)
        return trace(tracer, root, concrete_args)

    monkeypatch.setattr(torch.fx.Tracer, "trace", recorded)

    @kernel.kernel
    def shifted(x, by: float):
        return (x + by).abs().max()

    caller = threading.Thread(target=shifted, args=(torch.randn(4099), 0.25))  # as a collective's callback
    caller.start()
    caller.join()
    layer = torch.nn.Linear(3, 3)
    while kernel.compiling():
        layer(torch.ones(3))
    kernel._untraced_shared_graphs.cache_clear()  # the next compile puts the hand-built graph back
    assert traces and not any(traces)  # AOT's traces only, which call modules through
    assert [node.op for node in InterpreterShim._dummy_gm().graph.nodes] == ["placeholder", "output"]


def test_a_compiled_kernel_called_while_another_thread_fx_traces_runs_eagerly(monkeypatch):
    """The compile thread's AOT and inductor traces raise FX's process-wide tracing flag, and dynamo then refuses
    compiled calls on every other thread: a kernel runs eagerly meanwhile, with the same bits."""
    monkeypatch.setenv("NETGAIN_COMPILE", "1")

    @kernel.kernel
    def shifted(x, by: float):
        return (x + by).abs().max()

    x = torch.randn(4099)
    expected = shifted(x, 0.25)  # compiled now
    monkeypatch.setattr(torch.fx._symbolic_trace, "_is_fx_tracing_flag", True)
    assert torch.equal(shifted(x, 0.25), expected)
