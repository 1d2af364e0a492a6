"""Checkpoints: round trip, integrity checks, and crash safety of the directory swap."""
import json
import os

import numpy as np
import pytest

from forge_ml import checkpoint as ck
from forge_ml.checkpoint import (
    check_architecture, load_checkpoint, pack_tensors, save_checkpoint, unpack_tensors,
)
from forge_ml.data import DataLoader, write_shard
from forge_ml.errors import CheckpointError


def make_tensors(seed=0):
    r = np.random.default_rng(seed)
    params = {
        "wte.weight": r.standard_normal((64, 16)).astype(np.float32),
        "h.0.attn.c_attn.weight": r.standard_normal((16, 48)).astype(np.float32),
        "h.0.attn.c_attn.bias": r.standard_normal(48).astype(np.float32),
        "ln_f.weight": np.ones(16, np.float32),
    }
    m = {k: r.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
    v = {k: np.abs(r.standard_normal(v.shape)).astype(np.float32) for k, v in params.items()}
    tensors = pack_tensors(params, m, v)
    tensors["counts"] = np.arange(5, dtype=np.int64)
    return tensors


def make_meta(step=100):
    return {
        "config": {"n_layer": 1, "n_head": 2, "n_embd": 16, "vocab_size": 60, "padded_vocab_size": 64},
        "step": step,
        "optimizer": {"lr": 6e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        "rng": {"seed": 1337, "dropout_offset": 123456789012345678901234567890},
        "tokenizer": {"kind": "char", "chars": "abc\n"},
        "loss": float("nan"),
    }


def assert_same(a: dict, b: dict):
    assert list(a) == list(b) or sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k])


def test_round_trip(tmp_path):
    d = tmp_path / "ckpt"
    tensors, meta = make_tensors(), make_meta()
    save_checkpoint(d, tensors, meta)
    assert sorted(os.listdir(d)) == ["model.safetensors", "state.json"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no .tmp / .old left behind
    got, got_meta = load_checkpoint(d)
    assert_same(tensors, got)
    assert got_meta["step"] == 100 and got_meta["rng"] == meta["rng"]
    assert got_meta["optimizer"] == meta["optimizer"]
    assert np.isnan(got_meta["loss"])
    state = json.loads((d / "state.json").read_text())
    assert state["format_version"] == ck.FORMAT_VERSION
    assert state["model_file"]["sha256"] == ck.sha256_file(d / "model.safetensors")


def test_pack_unpack_convention():
    tensors = make_tensors()
    assert "opt.m.wte.weight" in tensors and "opt.v.wte.weight" in tensors
    params, m, v = unpack_tensors(tensors)
    assert set(m) == set(v) == set(params) - {"counts"}


def test_overwrite_replaces_whole_directory(tmp_path):
    d = tmp_path / "ckpt"
    save_checkpoint(d, make_tensors(0), make_meta(1))
    (d / "stray.txt").write_text("from the old run")
    save_checkpoint(d, make_tensors(1), make_meta(2))
    got, meta = load_checkpoint(d)
    assert meta["step"] == 2
    assert_same(got, make_tensors(1))
    assert sorted(os.listdir(d)) == ["model.safetensors", "state.json"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_resume_state_includes_data_loader(tmp_path):
    shard = tmp_path / "s.bin"
    write_shard(shard, np.arange(3000) % 50)
    dl = DataLoader(shard, 2, 16, seed=5)
    dl.next_batch()
    save_checkpoint(tmp_path / "c", make_tensors(), dict(make_meta(), data=dl.state_dict()))
    want = dl.next_batch()
    _, meta = load_checkpoint(tmp_path / "c")
    dl2 = DataLoader(shard, 2, 16, seed=0)
    dl2.load_state_dict(meta["data"])
    got = dl2.next_batch()
    np.testing.assert_array_equal(got[0], want[0])


# ---------------------------------------------------------------------------------------------
# Integrity


def test_truncated_safetensors(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    save_checkpoint(old, make_tensors(0), make_meta(1))
    save_checkpoint(new, make_tensors(1), make_meta(2))
    f = new / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        load_checkpoint(new)
    _, meta = load_checkpoint(old)  # the other checkpoint still loads
    assert meta["step"] == 1


def test_hash_mismatch(tmp_path):
    d = tmp_path / "c"
    save_checkpoint(d, make_tensors(), make_meta())
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF  # same size, one flipped byte in the data
    f.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        load_checkpoint(d)


def test_corrupted_json(tmp_path):
    d = tmp_path / "c"
    save_checkpoint(d, make_tensors(), make_meta())
    s = d / "state.json"
    s.write_text(s.read_text()[:50])
    with pytest.raises(CheckpointError, match=r"state\.json: bad JSON at line"):
        load_checkpoint(d)
    s.write_bytes(b"\xff\xfe garbage")
    with pytest.raises(CheckpointError, match=r"state\.json"):
        load_checkpoint(d)


def test_missing_key_and_unknown_version(tmp_path):
    d = tmp_path / "c"
    save_checkpoint(d, make_tensors(), make_meta())
    s = d / "state.json"
    state = json.loads(s.read_text())
    s.write_text(json.dumps({k: v for k, v in state.items() if k != "meta"}))
    with pytest.raises(CheckpointError, match="missing key 'meta'"):
        load_checkpoint(d)
    s.write_text(json.dumps(dict(state, format_version=99)))
    with pytest.raises(CheckpointError, match="format version 99 is unknown"):
        load_checkpoint(d)
    del state["model_file"]["sha256"]
    s.write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match="missing key 'sha256'"):
        load_checkpoint(d)


def test_missing_files(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "nope")
    d = tmp_path / "c"
    save_checkpoint(d, make_tensors(), make_meta())
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors is missing"):
        load_checkpoint(d)
    (d / "state.json").unlink()
    with pytest.raises(CheckpointError, match=r"state\.json is missing"):
        load_checkpoint(d)


def test_bad_inputs_write_nothing(tmp_path):
    d = tmp_path / "c"
    with pytest.raises(CheckpointError, match="JSON-able"):
        save_checkpoint(d, make_tensors(), {"x": object()})
    with pytest.raises(CheckpointError, match="NumPy array"):
        save_checkpoint(d, {"w": [1.0, 2.0]}, {})
    with pytest.raises(CheckpointError, match="dtype"):
        save_checkpoint(d, {"w": np.array(["a"])}, {})
    assert not d.exists() and os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Crash safety


def test_crash_while_writing_keeps_old(tmp_path, monkeypatch):
    d = tmp_path / "ckpt"
    save_checkpoint(d, make_tensors(0), make_meta(1))

    def crash(*a, **k):
        raise RuntimeError("simulated crash after the temp dir was written")

    monkeypatch.setattr(ck, "_swap_in", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        save_checkpoint(d, make_tensors(1), make_meta(2))
    monkeypatch.undo()
    got, meta = load_checkpoint(d)
    assert meta["step"] == 1
    assert_same(got, make_tensors(0))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_crash_between_renames_recovers_old(tmp_path, monkeypatch):
    d = tmp_path / "ckpt"
    save_checkpoint(d, make_tensors(0), make_meta(1))
    real_rename = os.rename
    calls = []

    def rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # old already moved aside, new not yet in: the process "dies"
            raise KeyboardInterrupt
        real_rename(src, dst)

    monkeypatch.setattr(ck.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(d, make_tensors(1), make_meta(2))
    monkeypatch.undo()
    # the swap's own rollback put the old checkpoint back
    _, meta = load_checkpoint(d)
    assert meta["step"] == 1


def test_hard_crash_between_renames_is_recovered(tmp_path):
    """A kill -9 after ``ckpt`` became ``ckpt.old`` (no rollback ran): load falls back to it,
    and the next save restores it before swapping."""
    d = tmp_path / "ckpt"
    save_checkpoint(d, make_tensors(0), make_meta(1))
    os.rename(d, tmp_path / "ckpt.old")
    (tmp_path / "ckpt.tmp").mkdir()  # a half-written temp dir
    (tmp_path / "ckpt.tmp" / "model.safetensors").write_bytes(b"\x00" * 10)
    _, meta = load_checkpoint(d)
    assert meta["step"] == 1
    save_checkpoint(d, make_tensors(1), make_meta(2))
    _, meta = load_checkpoint(d)
    assert meta["step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


# ---------------------------------------------------------------------------------------------
# Architecture check


def test_check_architecture_lists_everything():
    expected = {"a": (4, 4), "b": (128, 384), "c": (3,)}
    tensors = {"a": np.zeros((4, 4)), "b": np.zeros((768, 2304)), "d": np.zeros(2),
               "opt.m.a": np.zeros((4, 4))}
    with pytest.raises(CheckpointError) as e:
        check_architecture(expected, tensors)
    msg = str(e.value)
    assert "1 missing: c" in msg
    assert "1 unexpected: d" in msg
    assert "b: checkpoint has (768, 2304), model expects (128, 384)" in msg
    assert "opt.m.a" not in msg
    check_architecture(expected, {"a": np.zeros((4, 4)), "b": (128, 384), "c": np.zeros(3)})
