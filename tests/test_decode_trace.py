"""benchmarks/decode_gpu.py --trace's arithmetic (``trace_phases``) on marks made up here: a
replay of the layers step with known phase times, as decode_layers.cu's DL_TRACE build would
write them. Runs without a GPU."""
import numpy as np
import pytest

import _scripts


@pytest.fixture(scope="module")
def dg():
    return _scripts.load("benchmarks/decode_gpu.py")


def _replay(L, blocks, phases, release, skew):
    """Marks (3, max blocks, L, 16) ns: kernel after kernel (attn, mlp per layer, then the
    head), each block passing its wait (mark 2) `skew * block` ns after the first, then its
    phases (ns each, marks 3.. in order), the next kernel's first block passing its wait
    `release` ns after this kernel's last block's last mark. Marks 0 and 1 come before the
    wait."""
    nb = max(blocks)
    m = np.zeros((3, nb, L, 16))
    t = 1000.0
    for k, l in [(k, l) for l in range(L) for k in (0, 1)] + [(2, 0)]:
        for b in range(blocks[k]):
            w = t + skew * b
            m[k, b, l, 0], m[k, b, l, 1], m[k, b, l, 2] = w - 500, w - 100, w
            at = w
            for i, d in enumerate(phases[k]):
                at += d
                m[k, b, l, 3 + i] = at
        last = 3 + len(phases[k]) - 1
        t = m[k, :blocks[k], l, last].max() + release
    return m


def test_trace_phases_gives_back_the_times_it_was_made_of(dg):
    L, blocks = 3, (16, 8, 4)
    phases = ([200.0, 300.0, 50.0], [100.0, 400.0], [250.0, 1000.0, 30.0])
    release, skew = 700.0, 10.0
    kinds, step = dg.trace_phases(_replay(L, blocks, phases, release, skew), blocks, L)
    for k, name in enumerate(dg._TRACE_KINDS):
        a = kinds[name]
        n = 1 if k == 2 else L
        assert a["n"] == n
        # every block spends the same time in a phase, and the last block's lead is constant
        np.testing.assert_allclose(a["mean"][3:3 + len(phases[k])], n * np.array(phases[k]))
        np.testing.assert_allclose(a["last"][3:3 + len(phases[k])], n * np.array(phases[k]))
        # whole: the first block past its wait -> the last block's last mark
        np.testing.assert_allclose(a["whole"], n * (sum(phases[k]) + skew * (blocks[k] - 1)))
        # the mark before the wait: the blocks' mean wait (100 ns from mark 1 to 2)
        np.testing.assert_allclose(a["mean"][2], n * 100.0)
    # releases: every kernel but the first layer_attn has one
    assert kinds["layer_attn"]["n_release"] == L - 1
    assert kinds["layer_mlp"]["n_release"] == L and kinds["decode_head"]["n_release"] == 1
    np.testing.assert_allclose(kinds["layer_attn"]["release"], (L - 1) * release)
    np.testing.assert_allclose(kinds["layer_mlp"]["release"], L * release)
    whole = sum(kinds[n]["whole"] for n in dg._TRACE_KINDS)
    rel = sum(kinds[n]["release"] for n in dg._TRACE_KINDS)
    np.testing.assert_allclose(step, whole + rel)


def test_trace_phases_keeps_nanoseconds_on_the_epoch_clock(dg):
    """%globaltimer counts nanoseconds from the epoch (about 1.8e18): as float64 that steps by
    256 ns, which rounded 30 and 100 ns phases to 0 (a review's find). The marks come as uint64,
    as the device writes them."""
    L, blocks = 2, (16, 8, 4)
    phases = ([30.0, 100.0, 7.0], [100.0, 3.0], [250.0, 1000.0, 30.0])
    m = _replay(L, blocks, phases, 700.0, 10.0)
    epoch = np.where(m > 0, m.astype(np.uint64) + np.uint64(1_780_000_000_000_000_000), 0).astype(np.uint64)
    kinds, step = dg.trace_phases(epoch, blocks, L)
    want, want_step = dg.trace_phases(m, blocks, L)
    for name in dg._TRACE_KINDS:
        np.testing.assert_allclose(kinds[name]["mean"], want[name]["mean"])
        np.testing.assert_allclose(kinds[name]["release"], want[name]["release"])
    np.testing.assert_allclose(kinds["layer_attn"]["mean"][3:6], L * np.array(phases[0]))
    assert step == want_step


def test_trace_phases_skips_a_mark_some_block_did_not_reach(dg):
    """The head's blocks that are not the last leave before mark 7 (greedy): its phase is not
    counted, and the whole kernel ends at the last mark every block reached."""
    L, blocks = 1, (8, 8, 4)
    phases = ([100.0], [100.0], [100.0, 200.0, 300.0])
    m = _replay(L, blocks, phases, 500.0, 0.0)
    m[2, 1:, 0, 5] = 0.0   # only block 0 of the head reached mark 5
    kinds, _ = dg.trace_phases(m, blocks, L)
    head = kinds["decode_head"]
    assert head["mean"][5] == 0.0 and head["last"][5] == 0.0
    np.testing.assert_allclose(head["whole"], 300.0)
