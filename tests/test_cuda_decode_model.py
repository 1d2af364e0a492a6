"""GPT-2's whole batch-1 decoding step as one kernel (ops.decode_gpt2, decode_model.cu;
FORGE_FUSED_DECODE=on) and as two kernels a layer (decode_layers.cu; =layers), every test in
both modes: logits against a float64 forward of the same weights at every position (float32
and bf16), the keys and values it writes, its greedy choice against argmax of its logits, the
captured chain against the op-by-op one, and the cases it leaves to the op-by-op step; the
layers step at 2-4 rows against each row alone."""
import numpy as np
import pytest

import forge_ml as fm
from forge_ml import flags, ops
from forge_ml.models import GPT2, GPT2Config
from _gpu_checks import cuda_or_skip, round_bf16
from test_cuda_model import _varied

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module", autouse=True)
def gpu():
    cuda_or_skip()


@pytest.fixture(autouse=True, params=["on", "layers"])
def fused_on(request):
    with flags.override(FORGE_FUSED_DECODE=request.param):   # opt-in: experimental
        yield request.param


# head size 64 (every GPT-2), a padded vocabulary, more positions than one attention split
CFG = GPT2Config(vocab_size=1000, padded_vocab_size=1024, block_size=256, n_layer=3, n_head=2,
                 n_embd=128)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def f64_logits(cpu, ids, dtype):
    """Float64 logits (T, V) of the sequence ``ids`` from the weights ``cpu`` holds, rounded
    to bf16 first where the GPU model holds bf16."""
    m = cpu.to(dtype="float64")
    if dtype == "bfloat16":
        m = GPT2(m.config, {k: fm.tensor(round_bf16(v.numpy())) for k, v in m.params.items()})
    cache = m.new_cache(1, len(ids))
    out = m.forward_cached(fm.tensor(np.asarray(ids)[None]), cache)
    return out.numpy()[0, :, :cpu.config.vocab_size]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_step_matches_float64_at_every_position(dtype):
    """float32: within 5e-5 of the float64 forward (as the op-by-op step); bf16 (whose KV cache rounds every key and
    value, on either path): within the op-by-op bf16 step's error plus a quarter."""
    from forge_ml.inference.decode import DecodeStep
    cpu = _varied(GPT2.init(CFG, seed=11), 5)
    gpu = cpu.to("cuda", dtype=dtype)
    ids = np.random.default_rng(3).integers(0, CFG.vocab_size, 240)
    want = f64_logits(cpu, ids, dtype)
    cache = gpu.new_cache(1, 256)
    gpu.forward_cached(fm.tensor(ids[None, :4], device="cuda"), cache)
    step = DecodeStep(gpu, cache, graph=False)
    assert step.fused
    op_cache = gpu.new_cache(1, 256)
    gpu.forward_cached(fm.tensor(ids[None, :4], device="cuda"), op_cache)
    with flags.override(FORGE_FUSED_DECODE=False):
        op_step = DecodeStep(gpu, op_cache, graph=False)
    assert not op_step.fused
    worst = worst_op = 0.0
    for t in range(4, 240):
        got = step(ids[t:t + 1], t)[0]
        worst = max(worst, rel(got, want[t]))
        worst_op = max(worst_op, rel(op_step(ids[t:t + 1], t)[0], want[t]))
    if dtype == "float32":
        assert worst < 5e-5 and worst_op < 5e-5, (worst, worst_op)   # both ~2e-5 on an H200
    else:
        assert worst < 1.25 * worst_op, (worst, worst_op)
    # the keys and values it wrote are the op-by-op step's (within the two paths' rounding)
    for i in range(CFG.n_layer):
        for a, b in ((cache.k[i], op_cache.k[i]), (cache.v[i], op_cache.v[i])):
            a = a.to("float32").numpy()[0, :, :240]
            b = b.to("float32").numpy()[0, :, :240]
            # bf16: two paths, each rounding its keys and values once (0.037 seen on an H200)
            assert rel(a, b) < (1e-5 if dtype == "float32" else 6e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_greedy_chain_is_argmax_of_its_logits_and_replays_bit_for_bit(dtype):
    from forge_ml.inference.decode import DecodeStep
    gpu = _varied(GPT2.init(CFG, seed=12), 6).to("cuda", dtype=dtype)
    ids = np.random.default_rng(4).integers(0, CFG.vocab_size, (1, 6))
    caches = [gpu.new_cache(1, 256) for _ in range(3)]
    for c in caches:
        gpu.forward_cached(fm.tensor(ids, device="cuda"), c)
    graph = DecodeStep(gpu, caches[0])
    eager = DecodeStep(gpu, caches[1], graph=False)
    assert graph.fused and eager.fused
    g = np.stack(list(graph.greedy(ids[:, -1], 6, 200, chunk=8)))
    assert ("greedy", 8) in graph._graphs and caches[0].pos == 206
    e = np.stack(list(eager.greedy(ids[:, -1], 6, 200)))
    np.testing.assert_array_equal(g, e)
    host = DecodeStep(gpu, caches[2], graph=False)
    tok = ids[:, -1]
    for t in range(6, 206):
        logits = host(tok, t)
        tok = np.argmax(logits, axis=1)
        np.testing.assert_array_equal(tok, g[t - 6], err_msg=str(t))
    for i in range(CFG.n_layer):      # the replays wrote the caches as the eager kernels did
        np.testing.assert_array_equal(caches[0].k[i].numpy(), caches[1].k[i].numpy())


@pytest.mark.parametrize("width,padded", [(128, 1024), (384, 1002)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layers_head_gives_the_same_bits_for_any_grid(dtype, width, padded, fused_on,
                                                      monkeypatch):
    """decode_layers.cu's head: its grid (how the vocabulary's rows are dealt out: one round or
    many, every warp busy or not) changes no bit of the logits or of the greedy chain; in
    float32 (the rows streamed through shared memory) with slots of 4 rows (n_embd 128) and of
    2 (384), the last group short of its rows (1,002 padded rows: 250 groups of 4 and one of
    2); in bf16, 8 rows a warp at a time."""
    if fused_on != "layers":
        pytest.skip("decode_layers.cu's head kernel")
    from forge_ml.backends.cuda import decoder
    from forge_ml.inference.decode import DecodeStep
    cfg = GPT2Config(vocab_size=1000, padded_vocab_size=padded, block_size=256, n_layer=2,
                     n_head=width // 64, n_embd=width)
    gpu = _varied(GPT2.init(cfg, seed=13), 7).to("cuda", dtype=dtype)
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, (1, 8))
    assert decoder._head_rows(gpu.params["wte.weight"].data.dtype, width) == (
        8 if dtype == "bfloat16" else 2 if width == 384 else 4)

    rule = decoder._head_grid

    def run(grid):
        monkeypatch.setattr(decoder, "_layer_plans", {})     # a plan made with this grid
        monkeypatch.setattr(decoder, "_head_grid",
                            lambda groups, resident: grid or rule(groups, resident))
        cache = gpu.new_cache(1, 256)
        gpu.forward_cached(fm.tensor(ids, device="cuda"), cache)
        step = DecodeStep(gpu, cache, graph=False)
        assert step.fused
        logits = np.stack([step(np.array([t % cfg.vocab_size]), t) for t in range(8, 40)])
        chain = np.stack(list(step.greedy([3], 40, 30)))
        assert len(decoder._layer_plans) == 1
        plan = next(iter(decoder._layer_plans.values()))
        assert grid is None or plan.grid_head == grid
        return logits, chain

    want = run(None)   # the rule's grid: one round a warp at this vocabulary
    for grid in (1, 5, 9, 264):
        got = run(grid)
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"logits, grid {grid}")
        np.testing.assert_array_equal(got[1], want[1], err_msg=f"greedy, grid {grid}")
    assert np.isfinite(want[0]).all() and len(set(want[1].ravel().tolist())) > 1


def test_fused_chain_agrees_with_the_op_by_op_chain_at_gpt2_size():
    # GPT-2 124M's shapes (12 heads: 11 attention splits on an H200), float32, past 900
    from forge_ml.inference.decode import DecodeStep
    cfg = GPT2Config(n_layer=2)
    gpu = GPT2.init(cfg, seed=0).to("cuda")
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 900))
    fused_cache, op_cache = gpu.new_cache(1, 1024), gpu.new_cache(1, 1024)
    for c in (fused_cache, op_cache):
        gpu.forward_cached(fm.tensor(ids, device="cuda"), c)
    fused = DecodeStep(gpu, fused_cache)
    with flags.override(FORGE_FUSED_DECODE=False):
        op = DecodeStep(gpu, op_cache)
    assert fused.fused and not op.fused
    for t in (900, 901, 902):   # (a step past the filled rows is refused: DecodeStep._check_filled)
        tok = ids[:, -1] if t == 900 else np.array([7])
        a, b = fused(tok, t), op(tok, t)
        assert rel(a, b) < 1e-5, t
    a = np.stack(list(fused.greedy([3], 903, 20)))
    b = np.stack(list(op.greedy([3], 903, 20)))
    np.testing.assert_array_equal(a, b)


def test_what_the_fused_step_leaves_to_the_op_by_op_step():
    from forge_ml.backends.cuda import decoder
    from forge_ml.inference.decode import DecodeStep
    gpu = GPT2.init(CFG, seed=1).to("cuda")
    assert DecodeStep(gpu, gpu.new_cache(1, 64)).fused
    rows = 2 if flags.get("FORGE_FUSED_DECODE") == "on" else decoder.ROWS + 1
    assert not DecodeStep(gpu, gpu.new_cache(rows, 64)).fused         # more rows than it takes
    small = GPT2.init(GPT2Config(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=64),
                      seed=1).to("cuda")
    assert not DecodeStep(small, small.new_cache(1, 16)).fused        # head size 32
    with flags.override(FORGE_FUSED_DECODE=False):
        assert not DecodeStep(gpu, gpu.new_cache(1, 64)).fused
    with pytest.raises(fm.errors.DeviceError, match="decode_gpt2_ok"):
        small.decode_step_fused(fm.zeros((1, 1), "int32", "cuda"), fm.zeros((1,), "int32", "cuda"),
                                small.new_cache(1, 16), fm.zeros((1, 50), "float32", "cuda"))
    cache = gpu.new_cache(1, 64)
    with pytest.raises(fm.errors.DTypeError, match="ids must be int32"):
        gpu.decode_step_fused(fm.zeros((1, 1), "int64", "cuda"), fm.zeros((1,), "int32", "cuda"),
                              cache, fm.zeros((1, 1024), "float32", "cuda"))
    with pytest.raises(fm.errors.ShapeError, match="logits must be float32 with 1 x 1024"):
        gpu.decode_step_fused(fm.zeros((1, 1), "int32", "cuda"), fm.zeros((1,), "int32", "cuda"),
                              cache, fm.zeros((1, 1000), "float32", "cuda"))
    if flags.get("FORGE_FUSED_DECODE") == "layers" and DecodeStep(gpu, gpu.new_cache(2, 64)).fused:
        with pytest.raises(fm.errors.ShapeError, match="ids must hold 2 element"):
            gpu.decode_step_fused(fm.zeros((1, 1), "int32", "cuda"), fm.zeros((1,), "int32", "cuda"),
                                  gpu.new_cache(2, 64), fm.zeros((2, 1024), "float32", "cuda"))
    assert not ops.decode_gpt2_ok(fm.zeros((10, 64)), 1, fm.zeros((1, 1, 8, 64)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("C", [768, 1024, 1280, 1600])
def test_layers_step_takes_and_matches_at_every_gpt2_width(dtype, C, fused_on):
    """Batch-1 decoding takes the layers step at each GPT-2 width where it is the faster
    (decoder._layers_ok: layer_mlp's blocks in at most two rounds), and its logits agree with
    the float64 forward there as the kernel-per-op step's do. On an H100 or H200 (132 SMs),
    every width in bf16 and float32 up to 1,024 (GPT-2 medium); not float32 at 1,280 (large:
    three rounds, 445 tok/s against the kernel-per-op step's 492 on an H100) or 1,600 (XL:
    layer_mlp's 237,568 bytes are past Hopper's 232,448, and a variant that fit ran at 234
    against 270)."""
    from forge_ml.backends.cuda import decoder, runtime
    from forge_ml.inference.decode import DecodeStep
    _hopper_layers_or_skip(fused_on)
    dt = runtime.F32 if dtype == "float32" else runtime.BF16
    takes = decoder._layers_ok(dt, C)
    if runtime._sm_count(runtime._dev()) == 132:
        assert takes == (dtype == "bfloat16" or C <= 1024)
    cfg = GPT2Config(vocab_size=1000, padded_vocab_size=1024, block_size=64, n_layer=2,
                     n_head=C // 64, n_embd=C)
    cpu = GPT2.init(cfg, seed=C)
    gpu = cpu.to("cuda", dtype=dtype)
    ids = np.random.default_rng(C).integers(0, cfg.vocab_size, 40)
    want = f64_logits(cpu, ids, dtype)
    caches = [gpu.new_cache(1, 64) for _ in range(2)]
    for c in caches:
        gpu.forward_cached(fm.tensor(ids[None, :4], device="cuda"), c)
    step = DecodeStep(gpu, caches[0], graph=False)
    with flags.override(FORGE_FUSED_DECODE=False):
        op_step = DecodeStep(gpu, caches[1], graph=False)
    assert step.fused == takes and not op_step.fused
    worst = worst_op = 0.0
    for t in range(4, 40):
        worst = max(worst, rel(step(ids[t:t + 1], t)[0], want[t]))
        worst_op = max(worst_op, rel(op_step(ids[t:t + 1], t)[0], want[t]))
    if dtype == "float32":
        assert worst < 5e-5 and worst_op < 5e-5, (worst, worst_op)
    else:   # two paths rounding at different places: a wrong layout is off by O(1)
        assert worst < 1.5 * worst_op, (worst, worst_op)


def _hopper_layers_or_skip(fused_on):
    from forge_ml.backends.cuda import runtime
    if fused_on != "layers":
        pytest.skip("decode_layers.cu")
    if runtime._cc_major(runtime._dev()) != 9 or not runtime._launcher_ex():
        pytest.skip("the layers step is for Hopper GPUs")


def test_layers_step_takes_rows_where_they_fit(fused_on):
    """At 2-4 rows (decoder.ROWS) the layers step runs where layer_mlp's blocks for every row
    fit in two rounds: GPT-2 124M in bf16 up to 4 rows, in float32 up to 2; medium (bf16, one
    block an SM) up to 2; never past ROWS."""
    from forge_ml.backends.cuda import decoder, runtime
    _hopper_layers_or_skip(fused_on)
    if runtime._sm_count(runtime._dev()) != 132:
        pytest.skip("the figures are an H100's or H200's (132 SMs)")
    bf, f32 = runtime.BF16, runtime.F32
    assert decoder.ROWS == 4
    assert [decoder._layers_ok(bf, 768, b) for b in range(1, 7)] == [True] * 4 + [False] * 2
    assert [decoder._layers_ok(f32, 768, b) for b in range(1, 5)] == [True] * 2 + [False] * 2
    assert [decoder._layers_ok(bf, 1024, b) for b in range(1, 4)] == [True, True, False]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("B", [2, 3, 4])
def test_layers_step_rows_are_each_row_alone_bit_for_bit(dtype, B, fused_on):
    """decode_layers.cu at B rows (every row at one position, a grid row of blocks for each in
    every kernel): each row's logits, the keys and values it writes and its greedy chain
    (eager and replayed from a graph) are the bits the row gives alone at batch 1; and the
    rows' logits are within the float64 forward's bounds as the kernel-per-op step's at B
    rows are."""
    from forge_ml.inference.decode import DecodeStep
    _hopper_layers_or_skip(fused_on)
    cpu = _varied(GPT2.init(CFG, seed=14), 8)
    gpu = cpu.to("cuda", dtype=dtype)
    T, n = 30, 24
    toks = np.random.default_rng(7 + B).integers(0, CFG.vocab_size, (B, T))

    def run(rows, fused=True):
        """Every token of rows' sequences fed through the step from position 0, then a greedy
        chain of n from the last: (logits (T, b, V), chain (n, b), the cache)."""
        with flags.override(FORGE_FUSED_DECODE="layers" if fused else "off"):
            cache = gpu.new_cache(len(rows), 256)
            step = DecodeStep(gpu, cache, graph=False)
            assert step.fused == fused
            logits = np.stack([step(toks[rows, t], t) for t in range(T)])
            chain = np.stack(list(step.greedy(toks[rows, -1], T, n)))
        return logits, chain, cache

    rows = list(range(B))
    logits, chain, cache = run(rows)
    for b in rows:
        lb, cb, c1 = run([b])
        np.testing.assert_array_equal(logits[:, b], lb[:, 0], err_msg=f"row {b}'s logits")
        np.testing.assert_array_equal(chain[:, b], cb[:, 0], err_msg=f"row {b}'s chain")
        for i in range(CFG.n_layer):
            np.testing.assert_array_equal(cache.k[i].numpy()[b], c1.k[i].numpy()[0])
            np.testing.assert_array_equal(cache.v[i].numpy()[b], c1.v[i].numpy()[0])
    assert len({tuple(chain[:, b]) for b in rows}) > 1        # the rows differ
    # replayed from a graph (the chain's choices and one position for every row)
    with flags.override(FORGE_FUSED_DECODE="layers"):
        gcache = gpu.new_cache(B, 256)
        gstep = DecodeStep(gpu, gcache)
    assert gstep.fused
    for t in range(T):
        gstep(toks[:, t], t)
    g = np.stack(list(gstep.greedy(toks[:, -1], T, n, chunk=8)))
    assert ("greedy", 8) in gstep._graphs and gcache.pos == T + n
    np.testing.assert_array_equal(g, chain)
    # against float64, as the kernel-per-op step at B rows
    op_logits = run(rows, fused=False)[0]
    for b in rows:
        want = f64_logits(cpu, toks[b], dtype)
        worst = max(rel(logits[t, b], want[t]) for t in range(T))
        worst_op = max(rel(op_logits[t, b], want[t]) for t in range(T))
        if dtype == "float32":
            assert worst < 5e-5 and worst_op < 5e-5, (b, worst, worst_op)
        else:
            # two paths rounding at different places (1.53 seen at 2 rows on an H100, where
            # each row's bits are its batch-1 bits, above); a wrong row is off by O(1)
            assert worst < 2 * worst_op, (b, worst, worst_op)



def test_a_steps_plan_goes_with_its_cache(fused_on):
    """A plan (the step's device workspace, or its address table) was kept for ever, one for
    every cache decoded into. It lives while an array it was used with does: a second cache
    object over the same memory shares it, and it goes with the last of them."""
    import gc
    from forge_ml.backends.cuda import decoder
    plans = decoder._layer_plans if fused_on == "layers" else decoder._plans
    gpu = GPT2.init(CFG, seed=1).to("cuda", dtype="bfloat16")
    cache = gpu.new_cache(1, 64)
    if not gpu.fused_decode_ok(cache):
        pytest.skip("the fused step does not take this model here")

    def step(c):
        gpu.decode_step_fused(fm.zeros((1, 1), "int32", "cuda"), fm.zeros((1,), "int32", "cuda"),
                              c, fm.zeros((1, 1024), "float32", "cuda"))
    before = set(plans)
    step(cache)
    made = set(plans) - before
    assert len(made) == 1
    twin = type(cache)([fm.Tensor(t._data[:], t.device) for t in cache.k],   # views
                       [fm.Tensor(t._data[:], t.device) for t in cache.v], 0)
    step(twin)                                    # other objects, the same memory: one plan
    assert set(plans) - before == made
    del cache
    gc.collect()
    assert made <= set(plans)                     # the twin still uses it
    del twin
    gc.collect()
    assert not made & set(plans)

