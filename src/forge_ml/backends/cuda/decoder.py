"""GPT-2's whole decoding step for one row as one kernel (decode_model.cu) or for one to four
rows as two kernels a layer (decode_layers.cu): ``decode_gpt2`` (the FORGE_FUSED_DECODE
switch: layers, the two a layer, the default on a Hopper GPU (compute capability 9); on, the
one kernel, experimental; off, neither: the kernel-per-op step).

The grid is one block per SM, resident for the whole step; the stages (per layer: LN1 and
qkv, attention, projection, LN2 and fc, the MLP's projection; then LN_f, the LM head and the
argmax) meet at grid-wide barriers. ``_Plan`` holds what a step needs beyond the weights: the
geometry (how each matrix product is cut into work items), the table of every layer's
weight and cache addresses, a float32 workspace and the barrier's counter. A plan is made
once per set of weight and cache addresses (outside any graph capture: the first, op-by-op
call of a ``DecodeStep`` makes it) and kept; a captured step replays the kernel with the
same arguments. Kernels: decode_model.cu.

FORGE_FUSED_DECODE=layers (``_decode_layers``): per layer ``layer_attn`` (a cluster of 8
blocks a head: LN1, the head's q, k and v, its attention, its rows of the projection) and
``layer_mlp`` (LN2, the MLP in column slices, clusters of 8 summing their partial rows), then
``decode_head`` (LN_f, the logits, the greedy argmax); 2 L + 1 kernels with programmatic
dependent launch, each loading its weights into shared memory before it waits. No grid
barrier: no residency condition. A batch of B rows (all at one position) runs B copies of
each kernel's grid side by side (grid y = the row), where ``_layers_ok`` finds them faster
than the kernel-per-op step.

Limits of the experimental path: the grid barrier needs every block resident at once, which
one block per SM gives on a GPU the process has to itself (an MPS client limited to part of
the SMs would wait forever: leave the switch off there); a plan lives as long as the process
(a few hundred KB each, one per distinct set of weight and cache addresses), because a
captured step keeps reading its workspace.
"""
from __future__ import annotations

import weakref

import numpy as np

from ... import flags
from ...errors import ShapeError
from .runtime import (_DTYPES, _SFX, BF16, F32, _cc_major, _dev, _float_sfx, _guarded, _i32,
                      _launch, _launcher_ex, _sm_count, _takes, cupy)

_THREADS = 512        # decode_model.cu: DM_THREADS
_WARPS = 16
_KMAX, _CMAX, _KEYS, _HS = 6400, 1600, 1024, 64
_SMAX = 16            # DM_SMAX: K slices, and attention splits, at most
_BARS = 256           # DM_BARS
TIMING = False        # record each block's barrier times in plan.times (benchmarks/decode_gpu.py)
_VEC = {F32: 4}
if BF16 is not None:
    _VEC[BF16] = 8
# decode_model.cu's enum of the geometry array
_GEO = ("C", "H", "L", "V", "VP", "TMAX", "SPLITS",
        "QKV_LPR", "QKV_S", "QKV_KC", "PROJ_LPR", "PROJ_S", "PROJ_KC",
        "FC_LPR", "FC_S", "FC_KC", "OUT_LPR", "OUT_S", "OUT_KC",
        "X", "XM", "QKVP", "ATTP", "PROJP", "FCP", "OUTP", "ARGP")


def decode_gpt2_ok(dtype: str, C: int, H: int, Tmax: int, batch: int) -> bool:
    """Whether ``decode_gpt2`` takes this model and cache: float32 or bf16, head size 64,
    n_embd a multiple of 8 up to 1,600, and the FORGE_FUSED_DECODE switch not off: ``layers``
    (the default; a Hopper GPU, compute capability 9, n_embd a multiple of 64, a batch of
    ``batch`` rows where ``_layers_ok`` says so) or ``on`` (the one-kernel step,
    experimental: one row, an attention split of at most 1,024 keys)."""
    dt = _DTYPES.get(getattr(dtype, "name", dtype))
    mode = flags.get("FORGE_FUSED_DECODE")
    if mode == "off" or dt not in _VEC or batch < 1:
        return False
    if C % H or C // H != _HS or C % 8 or C > _CMAX or 4 * C > _KMAX:
        return False
    if mode == "layers":
        return _layers_ok(dt, C, batch)
    return batch == 1 and -(-Tmax // _splits(H)) <= _KEYS


def _splits(H: int) -> int:
    """Attention items per head: the SMs shared out among the heads, at most _SMAX."""
    return max(1, min(_SMAX, _sm_count(_dev()) // H))


def _stage(K: int, N: int, vec: int, itemsize: int, grid: int):
    """(lanes per row, K slices, rows per slice) of one matrix product: the cut whose busiest
    block streams the fewest rows, counting each slice a consumer must add, and tiles narrower
    than 64 bytes (half a DRAM burst) as dearer."""
    best = None
    for lpr in (8, 4, 2, 1):
        tiles = -(-N // (lpr * vec))
        for S in range(1, _SMAX + 1):
            kc = -(-K // S)
            rounds = -(-(tiles * S) // grid)
            steps = -(-kc // (_WARPS * 32 // lpr))
            cost = rounds * steps + 0.25 * S + (4.0 if lpr * vec * itemsize < 64 else 0.0)
            if best is None or cost < best[0]:
                best = (cost, lpr, S, kc)
    return best[1:]


class _Plan:
    """The geometry, the address table, the workspace and the barrier counter of one model's
    decoding step (see the module's docstring)."""

    def __init__(self, dtype, C, H, L, V, Vp, Tmax, layer_ptrs):
        grid = _sm_count(_dev())
        vec, item = _VEC[dtype], np.dtype(dtype).itemsize
        splits = _splits(H)
        stages = [_stage(C, 3 * C, vec, item, grid), _stage(C, C, vec, item, grid),
                  _stage(C, 4 * C, vec, item, grid), _stage(4 * C, C, vec, item, grid)]
        sizes = [("X", C), ("XM", C), ("QKVP", stages[0][1] * 3 * C),
                 ("ATTP", H * splits * (_HS + 2)), ("PROJP", stages[1][1] * C),
                 ("FCP", stages[2][1] * 4 * C), ("OUTP", stages[3][1] * C), ("ARGP", 2 * grid)]
        offsets, at = {}, 0
        for name, n in sizes:
            offsets[name] = at
            at += -(-n // 32) * 32
        geo = {"C": C, "H": H, "L": L, "V": V, "VP": Vp, "TMAX": Tmax, "SPLITS": splits}
        for prefix, (lpr, S, kc) in zip(("QKV", "PROJ", "FC", "OUT"), stages):
            geo.update({prefix + "_LPR": lpr, prefix + "_S": S, prefix + "_KC": kc})
        geo.update(offsets)
        self.grid, self.stages, self.splits = grid, stages, splits
        self.geo = cupy.asarray(np.array([geo[k] for k in _GEO], np.int32))
        self.table = cupy.asarray(np.array(layer_ptrs, np.uint64))
        self.work = cupy.zeros(at, F32)
        self.counter = cupy.zeros(1, np.uint64)
        self.times = None   # (grid, _BARS, 2) uint64 ns: each block's arrival and departure


_plans: dict = {}


def _plan_for(plans: dict, key, make, cache):
    """``plans[key]`` (made by ``make()`` where missing), kept for as long as some array object
    it was used with as ``cache`` (the step's first key cache, whose address is in ``key``)
    lives; when the last of them goes, so does the plan and the device memory it holds. A
    step's plan was kept for ever, one for every cache a process decoded into (a new
    ``generate()`` cache may come at a new address each time). A graph that replays the step
    keeps its cache, so it never outlives the plan it reads. An array without weak references
    keeps its plan for ever, as before."""
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = make()
        plan.users = set()
    if id(cache) not in plan.users:
        plan.users.add(id(cache))
        try:
            weakref.finalize(cache, _let_go, plans, key, plan, id(cache))
        except TypeError:   # no weak references: a user that never leaves
            pass
    return plan


def _let_go(plans: dict, key, plan, user: int) -> None:
    plan.users.discard(user)
    if not plan.users and plans.get(key) is plan:
        del plans[key]


def last_plan():
    """The plan made last (for benchmarks: its ``times``, ``stages``, ``splits``)."""
    return list(_plans.values())[-1] if _plans else None


@_guarded
def decode_gpt2(ids, pos, wte, wpe, lnf, head, layers, caches, n_head, eps, vocab_size, logits,
                out=None, greedy=False):
    """GPT-2's decoding step for B rows (the caches' batch; one kernel for one row with
    FORGE_FUSED_DECODE=on, 2 L + 1 with layers): ``logits (B, Vp)`` float32 for the tokens
    ``ids (B,)`` at the one position ``pos[0]`` (int32 device arrays), each token's keys and
    values written at that position of its row of ``caches`` (per layer (k, v), (B, H, Tmax,
    64)). ``layers``: per layer the 12 tensors of ``models.gpt2.Layer`` in its order; ``lnf``:
    (gamma, beta). ``greedy``: then also ``ids[b] = argmax(logits[b, :vocab_size])`` (also into
    ``out``, B int32 elements, when given: -1 there for a row whose largest logit is not
    finite) and ``pos[0] += 1``, as ``greedy_next``."""
    dt = wte.dtype
    C, H, L = wte.shape[1], int(n_head), len(layers)
    Vp, Tmax = head.shape[0], caches[0][0].shape[2]
    B = caches[0][0].shape[0]
    if not decode_gpt2_ok(dt, C, H, Tmax, B):
        raise ShapeError("decode_gpt2: this model or cache is not one the fused step takes "
                         "(see decode_gpt2_ok)")
    ptrs = []
    for t in [wte, wpe, head, logits, *lnf] + [t for lw in layers for t in lw] + [
            t for kv in caches for t in kv]:
        if not t.flags.c_contiguous or t.dtype != (F32 if t is logits else dt):
            raise ShapeError(f"decode_gpt2: every weight and cache must be a contiguous {dt} "
                             f"array (and the logits float32), got {t.dtype} {t.shape}")
    for lw, (k, v) in zip(layers, caches):
        ptrs.extend(int(t.data.ptr) for t in lw)
        ptrs.extend((int(k.data.ptr), int(v.data.ptr)))
    key = (_dev(), str(dt), C, H, L, int(vocab_size), Vp, Tmax, B, tuple(ptrs))
    if flags.get("FORGE_FUSED_DECODE") == "layers":
        _decode_layers(key, ids, pos, wte, wpe, lnf, head, layers, caches, H, eps,
                       int(vocab_size), logits, ids if out is None else out, greedy)
        return
    if key not in _plans and cupy.cuda.runtime.streamIsCapturing(
            cupy.cuda.get_current_stream().ptr):
        raise ShapeError("decode_gpt2: the first call for a model must run outside a graph "
                         "capture (it uploads the step's address table)")
    plan = _plan_for(_plans, key, lambda: _Plan(dt, C, H, L, int(vocab_size), Vp, Tmax, ptrs),
                     caches[0][0])
    if TIMING and plan.times is None:
        plan.times = cupy.zeros((plan.grid, _BARS, 2), np.uint64)
    times = plan.times if TIMING else np.uint64(0)
    _launch("decode_model", f"decode_model_{_float_sfx(wte)}", (plan.grid,), _THREADS,
            (plan.geo, plan.table, wte, wpe, lnf[0], lnf[1], head, plan.work, plan.counter, ids,
             pos, ids if out is None else out, _i32(1 if greedy else 0), np.float32(eps), logits,
             times))


# ---- FORGE_FUSED_DECODE=layers: decode_layers.cu ----------------------------------------------

_DL_THREADS, _DL_P, _DL_HEAD_THREADS = 256, 8, 256
_DL_HEAD_SLOTS = 3    # decode_layers.cu's DL_HEAD_SLOTS: a head warp's slots (float32)
_DL_CMAX = 1600       # decode_layers.cu's DL_CMAX: the widest n_embd


def _head_stream(dt) -> bool:
    """Whether ``decode_head`` streams the LM head's rows through shared memory (float32; bf16
    loads 8 rows a warp into registers: decode_layers.cu's DL_HEAD_STREAM says why)."""
    return np.dtype(dt).itemsize == 4


def _head_rows(dt, C: int) -> int:
    """Rows of the LM head a warp of ``decode_head`` takes at a time: float32, those of a slot
    (its G), as many as fit about 3 KB (up to 4), one where a row is longer; bf16, 8
    (DL_HEAD_ROWS).

    >>> [_head_rows(F32, C) for C in (64, 256, 768, 1600)]
    [4, 2, 1, 1]
    """
    if not _head_stream(dt):
        return 8
    rb = C * np.dtype(dt).itemsize
    return 4 if 4 * rb <= 3200 else 2 if 2 * rb <= 3200 else 1


def _head_shared(dt, C: int) -> int:
    """Dynamic shared bytes of ``decode_head``: every warp's slots (float32; bf16 none).

    >>> _head_shared(F32, 768), _head_shared(F32, 1600)
    (73728, 153600)
    """
    if not _head_stream(dt):
        return 0
    warps = _DL_HEAD_THREADS // 32
    return warps * _DL_HEAD_SLOTS * _head_rows(dt, C) * C * np.dtype(dt).itemsize


def _head_static(dt) -> int:
    """``decode_head``'s static shared bytes (at most): xs, vs and the small arrays."""
    return 4 * _DL_CMAX + 3 * _DL_CMAX * np.dtype(dt).itemsize + 4 * (32 + 32 + 32 + 1)


def _head_blocks(dt, C: int, sm_shared: int, reserved: int = 1024) -> int:
    """Blocks of ``decode_head`` an SM holds: its shared memory's share, at most 2 (256
    threads of 128 registers a block).

    >>> _head_blocks(F32, 768, 233472), _head_blocks(F32, 1600, 233472)
    (2, 1)
    """
    return max(1, min(2, sm_shared // (_head_shared(dt, C) + _head_static(dt) + reserved)))


def _head_grid(groups: int, resident: int) -> int:
    """Blocks of ``decode_head`` for ``groups`` groups of rows (the vocabulary's padded rows
    in groups of ``_head_rows``) where the GPU holds ``resident`` blocks at once: as many
    rounds of groups as those blocks' warps take, dealt out so that every warp has that many
    (the fewest blocks for them). At GPT-2's 50,304 rows on an H100 (264 blocks at once):
    bf16 (8 rows a warp at a time), 262 blocks of 3 rounds; float32 (G 1), 262 of 24. Sized
    so since 2026-12-06: 16 warps a block, 197 blocks of two rounds, where 264 had left half
    the warps a second round: +0.5 to +3% on batch-1 greedy ``generate()``, bf16 and float32,
    H100; 8 warps a block with 128 registers a thread: +1.4 to +2.7% more, session 37.

    >>> _head_grid(6288, 264), _head_grid(50304, 264), _head_grid(16, 264)
    (262, 262, 2)
    """
    warps = _DL_HEAD_THREADS // 32
    rounds = -(-groups // (resident * warps))
    return -(-groups // (rounds * warps))


def _attn_shared(dt, C: int) -> int:
    """Dynamic shared bytes of ``layer_attn`` (decode_layers.cu's dl_attn_shared, the same
    sum).

    >>> _attn_shared(BF16, 768) if BF16 is not None else 62336
    62336
    """
    vec, item = _VEC[dt], np.dtype(dt).itemsize
    kq = np_ = C // _DL_P
    nv = 3 * _HS // vec
    rg = _DL_THREADS // nv
    nvp = np_ // vec
    dg = _DL_THREADS // nvp
    scr = max(rg * 3 * _HS, (_DL_THREADS // 32) * _HS, dg * np_, C)
    at = kq * 3 * _HS * item + _HS * np_ * item + 2 * _HS * item + (C + 2 * kq + 3 * _HS) * item
    at = -(-at // 16) * 16
    return at + 4 * (kq + 3 * _HS + 3 * _HS + _HS + 32 + 32 + scr + 32)


def _mlp_shared(dt, C: int) -> int:
    """Dynamic shared bytes of ``layer_mlp`` (decode_layers.cu's dl_mlp_shared).

    >>> _mlp_shared(BF16, 768) if BF16 is not None else 110400
    110400
    """
    vec, item = _VEC[dt], np.dtype(dt).itemsize
    nh = 4 * vec
    return (2 * C * nh + 3 * C + nh) * item + 4 * (C + (_DL_THREADS // 32) * nh + nh + C + 32)


def _mlp_waves(dt, C: int, sms: int, sm_shared: int, reserved: int = 1024, rows: int = 1) -> int:
    """Rounds in which a GPU of ``sms`` SMs, each with ``sm_shared`` bytes of shared memory,
    runs ``layer_mlp``'s C / VEC blocks for each of ``rows`` rows of the batch: each SM holds
    as many blocks as its shared memory takes (a block's dynamic bytes and the ``reserved``
    bytes CUDA keeps a block), at most 2 (a block's 256 threads take 128 registers each:
    32,768 of an SM's 65,536).

    >>> [_mlp_waves(F32, C, 132, 233472) for C in (768, 1024, 1280)]
    [1, 2, 3]
    >>> [_mlp_waves(BF16, 768, 132, 233472, rows=b) for b in (1, 2, 3, 4, 5, 6)] if BF16 else 0
    [1, 1, 2, 2, 2, 3]
    """
    per_sm = min(2, sm_shared // (_mlp_shared(dt, C) + reserved))
    return -(-(rows * (C // _VEC[dt])) // (sms * per_sm)) if per_sm else 1 << 30


ROWS = 4              # the most rows decode_layers.cu takes (benchmarks may raise it)
_ok: dict = {}        # (device, dtype, C, rows, ROWS) -> _layers_ok's answer there


def _layers_ok(dt, C: int, rows: int = 1) -> bool:
    """Whether decode_layers.cu takes n_embd ``C`` and a batch of ``rows`` (``decode_gpt2_ok``
    has checked the rest: C = 64 H, at most 1,600): a Hopper GPU (compute capability 9.x:
    thread-block clusters, ``_launcher_ex``, and the GPUs its tests and timings ran on), both
    kernels' shared memory within the device's, at most ``ROWS`` rows, and ``layer_mlp``'s
    blocks (C / VEC a row) in at most two rounds (``_mlp_waves``): a block of a later round
    loads its weights after the kernel before has ended, where the first round's load under
    it. Batch-1 greedy ``generate()``, 16 -> 1,024 tokens on an H100 (2026-12-06), layers step
    against the kernel-per-op step, tok/s: bf16 124M 4,491 / 2,248, medium 1,764 / 932, large
    863 / 528, XL 417 / 322 (one or two rounds); float32 medium 934 / 899 (two rounds), large
    445 / 492 (three rounds), and XL (four rounds, in a variant that fit its shared memory)
    234 / 270. A kernel file that does not compile here is a no (``runtime._takes``; the
    failure is kept, not compiled again on the next step): the kernel-per-op step runs (it is
    the default path, so it must not fail where the step it replaces works). The answer is
    kept per device, dtype, width and rows (asked before every step run outside a graph)."""
    dev = _dev()
    key = (dev, np.dtype(dt), C, int(rows), ROWS)
    ok = _ok.get(key)
    if ok is None:
        ok = _ok[key] = _layers_ask(dev, dt, C, int(rows))
    return ok


def _layers_ask(dev, dt, C: int, rows: int) -> bool:
    """``_layers_ok``'s answer, worked out."""
    if _cc_major(dev) != 9 or not _launcher_ex() or not 1 <= rows <= ROWS:
        return False
    props = cupy.cuda.runtime.getDeviceProperties(dev)
    if _mlp_waves(dt, C, int(props["multiProcessorCount"]), int(props["sharedMemPerMultiprocessor"]),
                  int(props.get("reservedSharedMemPerBlock", 1024)), rows) > 2:
        return False
    sfx = _SFX[np.dtype(dt)]
    return (_takes("decode_layers", f"layer_attn_{sfx}", _attn_shared(dt, C))
            and _takes("decode_layers", f"layer_mlp_{sfx}", _mlp_shared(dt, C))
            and _takes("decode_layers", f"decode_head_{sfx}", _head_shared(dt, C)))


class _LayersPlan:
    """The float32 workspace of one model's two-kernels-a-layer step, for each of its B rows:
    x after the attention (xa) and after the MLP (xb), each head's partial projection row
    (partA, H x C), each MLP cluster's partial row (partB), the head kernel's per-block argmax
    and its counter; and one counter more, of the rows whose greedy choice is made."""

    def __init__(self, dt, C: int, H: int, Vp: int, B: int = 1):
        self.grid_mlp = C // _VEC[dt]                 # blocks of layer_mlp, a row
        self.SB = self.grid_mlp // _DL_P              # its clusters: partB's rows
        props = cupy.cuda.runtime.getDeviceProperties(_dev())
        self.head_rows = _head_rows(dt, C)
        self.head_shared = _head_shared(dt, C)
        resident = _sm_count(_dev()) * _head_blocks(
            dt, C, int(props["sharedMemPerMultiprocessor"]),
            int(props.get("reservedSharedMemPerBlock", 1024)))
        self.grid_head = _head_grid(-(-Vp // self.head_rows), resident)
        self.B = B
        self.xa = cupy.zeros((B, C), F32)
        self.xb = cupy.zeros((B, C), F32)
        self.partA = cupy.zeros((B, H, C), F32)
        self.partB = cupy.zeros((B, self.SB, C), F32)
        self.argp = cupy.zeros((B, 2 * self.grid_head), F32)
        self.counter = cupy.zeros(B + 1, np.uint32)
        self.attn_shared, self.mlp_shared = _attn_shared(dt, C), _mlp_shared(dt, C)


_layer_plans: dict = {}


def _decode_layers(key, ids, pos, wte, wpe, lnf, head, layers, caches, H, eps, V, logits, hist,
                   greedy):
    """``decode_gpt2`` as 2 L + 1 kernels (decode_layers.cu), each with a row of blocks for
    each of the cache's rows; ``key`` names the plan (the model's shapes, rows and addresses,
    as the one-kernel step's)."""
    dt = wte.dtype
    C, Vp, Tmax = wte.shape[1], head.shape[0], caches[0][0].shape[2]
    if any(p % 16 for p in key[-1] + (int(head.data.ptr),)):   # cp.async, 16-byte loads
        raise ShapeError("decode_gpt2: FORGE_FUSED_DECODE=layers needs every weight and cache "
                         "on a 16-byte boundary; one is not (a view into a larger array?)")
    if key not in _layer_plans and cupy.cuda.runtime.streamIsCapturing(
            cupy.cuda.get_current_stream().ptr):
        raise ShapeError("decode_gpt2: the first call for a model must run outside a graph "
                         "capture (it makes the step's workspace)")
    plan = _plan_for(_layer_plans, key, lambda: _LayersPlan(dt, C, H, Vp, caches[0][0].shape[0]),
                     caches[0][0])
    sfx, epsf = _float_sfx(wte), np.float32(eps)
    for i, (lw, (kc, vc)) in enumerate(zip(layers, caches)):
        g1, b1, wqkv, bqkv, wproj, bproj, g2, b2, wfc, bfc, wfc2, bfc2 = lw
        bprev = layers[i - 1][11] if i else bfc2      # the MLP bias x' still lacks (unused at 0)
        _launch("decode_layers", f"layer_attn_{sfx}", (H * _DL_P, plan.B), _DL_THREADS,
                (ids, pos, wte, wpe, _i32(1 if i == 0 else 0), plan.xb, bprev, plan.partB,
                 _i32(plan.SB), g1, b1, wqkv, bqkv, wproj, kc, vc, plan.xa, plan.partA, _i32(C),
                 _i32(Tmax), epsf), shared=plan.attn_shared, pdl=True,
                writes=(kc, vc, plan.xa, plan.partA), cluster=(_DL_P, 1, 1))
        _launch("decode_layers", f"layer_mlp_{sfx}", (plan.grid_mlp, plan.B), _DL_THREADS,
                (plan.xa, bproj, plan.partA, _i32(H), g2, b2, wfc, bfc, wfc2, plan.xb, plan.partB,
                 _i32(C), epsf), shared=plan.mlp_shared, pdl=True, writes=(plan.xb, plan.partB),
                cluster=(_DL_P, 1, 1))
    _launch("decode_layers", f"decode_head_{sfx}", (plan.grid_head, plan.B), _DL_HEAD_THREADS,
            (plan.xb, layers[-1][11], plan.partB, _i32(plan.SB), lnf[0], lnf[1], head, logits,
             _i32(C), _i32(Vp), _i32(V), epsf, _i32(1 if greedy else 0), ids, pos, hist,
             plan.argp, plan.counter, _i32(plan.head_rows)), shared=plan.head_shared, pdl=True,
            writes=(logits, ids, pos, hist, plan.argp, plan.counter))
