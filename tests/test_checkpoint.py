"""Checkpoints: round trip, integrity checks, crash safety of the directory swap, and what a
save may replace."""
import errno
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from forge_ml import checkpoint as ck
from forge_ml.checkpoint import (
    check_architecture, load_checkpoint, pack_tensors, save_checkpoint, unpack_tensors,
)
from forge_ml.data import DataLoader, write_shard
from forge_ml.errors import CheckpointError


_KILLED_MID_DELETE = """
import os, shutil, sys
import numpy as np
from forge_ml.checkpoint import save_checkpoint
from forge_ml.hf import save_hf_gpt2
d, which = sys.argv[1], sys.argv[2]
def write(n):
    if which == "ckpt":
        save_checkpoint(d, {"w": np.full(3, n, np.float32)}, {"step": n})
    else:
        from forge_ml.models import GPT2Config
        cfg = GPT2Config(vocab_size=8, block_size=4, n_layer=1, n_head=1, n_embd=4)
        from forge_ml.models import GPT2
        save_hf_gpt2(d, cfg, GPT2.init(cfg, seed=n).state_dict())
write(1)
real = shutil.rmtree
def killed(path, *a, **k):        # the old copy's marker file goes first, then the process dies
    names = sorted(os.listdir(path), key=lambda n: n not in ("state.json", "config.json"))
    os.unlink(os.path.join(path, names[0]))
    os._exit(9)
shutil.rmtree = killed
write(2)
"""


@pytest.mark.parametrize("which", ["ckpt", "hf"])
def test_a_kill_while_the_old_copy_is_deleted_blocks_nothing(tmp_path, which):
    """Killed between the deletions of <dir>.old's files, a save left <dir>.old holding only
    model.safetensors, and every later save (every --resume) refused it as a folder forge-ml
    did not write. The old copy is now deleted under <dir>.tmp, scratch the next save removes."""
    import subprocess
    import sys
    src = str(Path(__file__).resolve().parents[1] / "src")
    d = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", _KILLED_MID_DELETE, str(d), which], timeout=120,
                       env=dict(os.environ, PYTHONPATH=src), capture_output=True, text=True)
    assert r.returncode == 9, r.stderr
    assert not (tmp_path / "out.old").exists()
    if which == "ckpt":
        assert load_checkpoint(d)[1]["step"] == 2          # the new one is in place
        save_checkpoint(d, {"w": np.full(3, 3, np.float32)}, {"step": 3})
        assert load_checkpoint(d)[1]["step"] == 3
    else:
        from forge_ml.hf import save_hf_gpt2
        from forge_ml.models import GPT2, GPT2Config
        cfg = GPT2Config(vocab_size=8, block_size=4, n_layer=1, n_head=1, n_embd=4)
        save_hf_gpt2(d, cfg, GPT2.init(cfg, seed=3).state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


_SAVE_MANY = """
import sys
import numpy as np
from forge_ml.checkpoint import save_checkpoint
d, n = sys.argv[1], int(sys.argv[2])
for i in range(40):
    save_checkpoint(d, {"w": np.full(20000, n, np.float32)}, {"step": n})
"""


def test_two_processes_writing_one_folder_take_turns(tmp_path):
    """Two writers of one folder (two `convert --force` to one --out) shared <dir>.tmp: one
    deleted the other's scratch midway, saves failed, and the folder could be left empty or
    holding a stray temporary file that refused every later write. A lock beside the folder
    makes them take turns."""
    import subprocess
    import sys
    src = str(Path(__file__).resolve().parents[1] / "src")
    d = tmp_path / "out"
    procs = [subprocess.Popen([sys.executable, "-c", _SAVE_MANY, str(d), str(n)], text=True,
                              env=dict(os.environ, PYTHONPATH=src), stderr=subprocess.PIPE)
             for n in (1, 2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    tensors, meta = load_checkpoint(d)
    assert meta["step"] in (1, 2) and (tensors["w"] == meta["step"]).all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]        # no lock, .tmp or .old left


def test_the_write_lock_follows_no_link_and_fits_a_long_name(tmp_path):
    """From a re-test: a link planted at .<name>.lock was followed (its target created, as
    the writer); a folder name of 250 characters failed ('File name too long': the lock's
    name is six longer) where it had been written before."""
    target = tmp_path / "elsewhere"
    (tmp_path / ".c.lock").symlink_to(target)
    with pytest.raises(CheckpointError, match="cannot write"):
        save_checkpoint(tmp_path / "c", make_tensors(0), make_meta(1))
    assert not target.exists() and not (tmp_path / "c").exists()
    long = tmp_path / ("x" * 250)
    save_checkpoint(long, make_tensors(0), make_meta(1))
    assert load_checkpoint(long)[1]["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [".c.lock", "x" * 250]


def test_a_0d_tensor_comes_back_0d(tmp_path):
    """A scalar parameter (a learnable temperature) came back (1,): ascontiguousarray makes
    every array at least 1-d, and check_architecture then refused the checkpoint."""
    t = {"logit_scale": np.array(2.5, np.float32), "w": np.ones((2, 3), np.float64).T}
    save_checkpoint(tmp_path / "c", t, make_meta())
    back, _ = load_checkpoint(tmp_path / "c")
    assert back["logit_scale"].shape == () and float(back["logit_scale"]) == 2.5
    np.testing.assert_array_equal(back["w"], t["w"])
    check_architecture({k: v.shape for k, v in t.items()}, back)
from test_cli_files import denied_open, tree  # the file-system test helpers


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
    save_checkpoint(d, make_tensors(1), make_meta(2))
    got, meta = load_checkpoint(d)
    assert meta["step"] == 2
    assert_same(got, make_tensors(1))
    assert sorted(os.listdir(d)) == ["model.safetensors", "state.json"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_checkpoint_folder_holding_a_users_file_is_not_replaced(tmp_path):
    """A save replaces only what save_checkpoint wrote: a stray file is the user's."""
    d = tmp_path / "ckpt"
    save_checkpoint(d, make_tensors(0), make_meta(1))
    (d / "stray.txt").write_text("the user's")
    with pytest.raises(CheckpointError, match=r"not empty .*stray\.txt.*refusing"):
        save_checkpoint(d, make_tensors(1), make_meta(2))
    assert (d / "stray.txt").read_text() == "the user's"
    assert load_checkpoint(d)[1]["step"] == 1
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
    (tmp_path / ".ckpt.swap").touch()   # the save's marker: its write was underway
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


# ---------------------------------------------------------------------------------------------
# Writing only what is ours; full disks, read-only filesystems, unreadable files


def test_a_save_never_replaces_a_folder_it_did_not_write(tmp_path, monkeypatch):
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / "data" / "train.bin").write_bytes(b"\x01" * 10)
    (run / "log.jsonl").write_text('{"step": 1}\n')
    save_checkpoint(run / "ckpt", make_tensors(0), make_meta(1))
    before = tree(tmp_path)
    with pytest.raises(CheckpointError, match=r"run is not empty .*ckpt, data, log\.jsonl"):
        save_checkpoint(run, make_tensors(1), make_meta(2))
    monkeypatch.chdir(run)
    with pytest.raises(CheckpointError, match="is or holds the current folder"):
        save_checkpoint(".", make_tensors(1), make_meta(2))   # a ValueError traceback before
    assert tree(tmp_path) == before


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root deletes from read-only folders")
@pytest.mark.parametrize("which", ["ckpt", "ckpt.tmp"])
def test_a_read_only_checkpoint_folder_is_refused_before_the_swap(tmp_path, which):
    # before: the swap put the new checkpoint in place, failed to delete the old one (quietly)
    # and left it as ckpt.tmp, where the next save failed naming ckpt
    d = tmp_path / "ckpt"
    save_checkpoint(d, make_tensors(0), make_meta(1))
    if which == "ckpt.tmp":
        (tmp_path / which).mkdir()
        (tmp_path / which / "model.safetensors").write_bytes(b"")
    os.chmod(tmp_path / which, 0o555)
    try:
        before = tree(tmp_path)
        with pytest.raises(CheckpointError, match=rf"{which} is read-only \(dr-xr-xr-x\).*chmod u\+w"):
            save_checkpoint(d, make_tensors(1), make_meta(2))
        assert tree(tmp_path) == before
    finally:
        os.chmod(tmp_path / which, 0o755)
    save_checkpoint(d, make_tensors(1), make_meta(2))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_folder_the_process_cannot_delete_from_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    # the read-only case as the check sees it, for a root run (root deletes from any folder)
    d = tmp_path / "ckpt"
    save_checkpoint(d, make_tensors(0), make_meta(1))
    real = os.access
    monkeypatch.setattr(ck.os, "access", lambda p, mode, **kw: False if Path(p) == d else real(p, mode, **kw))
    before = tree(tmp_path)
    with pytest.raises(CheckpointError, match=r"ckpt is read-only .*nothing was written"):
        save_checkpoint(d, make_tensors(1), make_meta(2))
    with pytest.raises(CheckpointError, match=r"ckpt is read-only"):
        ck.check_checkpoint_target(d)
    assert tree(tmp_path) == before


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symbolic links")
def test_a_checkpoint_moved_to_another_disk_and_linked_back_is_replaced_there(tmp_path):
    (tmp_path / "big").mkdir()
    save_checkpoint(tmp_path / "big" / "ckpt", make_tensors(0), make_meta(1))
    try:
        os.symlink(tmp_path / "big" / "ckpt", tmp_path / "ckpt")
    except OSError:
        pytest.skip("cannot make symbolic links here")
    save_checkpoint(tmp_path / "ckpt", make_tensors(1), make_meta(2))
    assert os.path.islink(tmp_path / "ckpt")  # the link stays and names the new checkpoint
    assert load_checkpoint(tmp_path / "big" / "ckpt")[1]["step"] == 2
    assert sorted(os.listdir(tmp_path / "big")) == ["ckpt"]
    # a link to a folder that is not a checkpoint is refused, as the folder itself is
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "thesis.tex").write_text("mine")
    os.symlink(tmp_path / "notes", tmp_path / "c2")
    with pytest.raises(CheckpointError, match="is not a checkpoint that forge-ml wrote"):
        save_checkpoint(tmp_path / "c2", make_tensors(1), make_meta(2))
    assert os.listdir(tmp_path / "notes") == ["thesis.tex"]


def test_an_unreadable_state_json_is_not_called_someone_elses_folder(tmp_path, monkeypatch):
    d = tmp_path / "ckpt"
    save_checkpoint(d, make_tensors(0), make_meta(1))
    real = open

    def eio(path, *a, **kw):
        if str(path).endswith("state.json"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return real(path, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(ck, "open", eio, raising=False)
        with pytest.raises(CheckpointError) as e:
            save_checkpoint(d, make_tensors(1), make_meta(2))
    assert "Input/output error" in str(e.value) and "state.json" in str(e.value)
    assert "not a checkpoint that forge-ml wrote" not in str(e.value)
    assert load_checkpoint(d)[1]["step"] == 1


def test_a_users_folder_named_like_the_temporary_one_is_kept(tmp_path):
    (tmp_path / "ckpt.tmp").mkdir()
    (tmp_path / "ckpt.tmp" / "thesis.tex").write_text("mine")
    with pytest.raises(CheckpointError, match=r"ckpt\.tmp is in the way.*not one forge-ml left"):
        save_checkpoint(tmp_path / "ckpt", make_tensors(), make_meta())
    (tmp_path / ".ckpt.swap").touch()   # even where a write was underway: not its files
    with pytest.raises(CheckpointError, match=r"ckpt\.tmp is in the way.*thesis\.tex"):
        save_checkpoint(tmp_path / "ckpt", make_tensors(), make_meta())
    assert (tmp_path / "ckpt.tmp" / "thesis.tex").read_text() == "mine"
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("how", ["copy", "move"])
def test_a_users_backup_named_like_the_old_copy_is_never_deleted_or_loaded(tmp_path, how):
    """A QA report: `cp -r ckpt ckpt.old` (or `mv`) as a backup was deleted by the next save as
    a stale old copy (or put back, or loaded, where ckpt was missing): only a write's marker
    (.ckpt.swap, there while one is underway) makes <dir>.old forge-ml's. Now the save is
    refused, naming it, and the backup is neither loaded nor touched."""
    import shutil
    d = tmp_path / "ckpt"
    save_checkpoint(d, make_tensors(0), make_meta(1))
    (shutil.copytree if how == "copy" else os.rename)(d, tmp_path / "ckpt.old")
    before = sorted(os.listdir(tmp_path / "ckpt.old"))
    if how == "move":
        with pytest.raises(CheckpointError, match="checkpoint not found"):
            load_checkpoint(d)
    with pytest.raises(CheckpointError, match=r"ckpt\.old is in the way.*not one forge-ml left"):
        save_checkpoint(d, make_tensors(1), make_meta(2))
    assert sorted(os.listdir(tmp_path / "ckpt.old")) == before
    assert load_checkpoint(tmp_path / "ckpt.old")[1]["step"] == 1


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EDQUOT])
@pytest.mark.parametrize("how", ["oserror", "safetensors"])
def test_full_disk_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, code, how):
    d = tmp_path / "ckpt"
    save_checkpoint(d, make_tensors(0), make_meta(1))
    import safetensors.numpy

    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)                 # half a file, then the disk is full
        if how == "oserror":
            raise OSError(code, os.strerror(code), filename)
        raise safetensors.SafetensorError(f"Error while serializing: I/O error: {os.strerror(code)} "
                                          f"(os error {code})")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(d, make_tensors(1), make_meta(2))
    msg = str(e.value)
    assert "\n" not in msg and str(d) in msg and os.strerror(code) in msg and "unchanged" in msg
    monkeypatch.undo()
    assert load_checkpoint(d)[1]["step"] == 1
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]      # no half-written ckpt.tmp left


def test_read_only_filesystem_before_anything_is_written(tmp_path, monkeypatch):
    real = os.mkdir

    def ro(path, *a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(os, "mkdir", ro)
    with pytest.raises(CheckpointError, match=r"cannot write .*ckpt: Read-only file system .*; nothing was written"):
        save_checkpoint(tmp_path / "ckpt", make_tensors(), make_meta())
    monkeypatch.setattr(os, "mkdir", real)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", ["state.json", "model.safetensors"])
def test_an_unreadable_checkpoint_file_names_the_file_and_the_cause(tmp_path, monkeypatch, name):
    d = tmp_path / "ckpt"
    save_checkpoint(d, make_tensors(), make_meta())
    denied_open(monkeypatch, name)
    with pytest.raises(CheckpointError, match=rf"{name}: cannot read it: Permission denied"):
        load_checkpoint(d)


def test_safe_target_refuses_special_files(tmp_path):
    """A shard or file writer renames a temporary file over its target: over a device or a
    FIFO that would replace the node with a regular file."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="pipe is a FIFO, not a regular file"):
        ck.safe_target(fifo)
    with pytest.raises(CheckpointError, match="is a directory"):
        ck.safe_target(tmp_path)
    from forge_ml.errors import DataError
    with pytest.raises(DataError, match="character device"):
        ck.safe_target("/dev/null", DataError)
    (tmp_path / "f.bin").write_bytes(b"x")
    assert ck.safe_target(tmp_path / "f.bin") == tmp_path / "f.bin"
    assert ck.safe_target(tmp_path / "new.bin") == tmp_path / "new.bin"
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)       # untouched


def test_checkpoint_files_get_the_users_umask(tmp_path):
    """safetensors writes 0600 whatever the umask; a checkpoint is shared like any other file."""
    old = os.umask(0o022)
    try:
        save_checkpoint(tmp_path / "ckpt", make_tensors(), make_meta())
    finally:
        os.umask(old)
    for name in ("model.safetensors", "state.json"):
        assert stat.S_IMODE(os.stat(tmp_path / "ckpt" / name).st_mode) == 0o644, name


def test_equal_checkpoints_are_equal_files(tmp_path):
    """The same tensors and meta saved again give the same bytes (safetensors wrote its
    metadata keys in a hash map's order, different from one save to the next)."""
    tensors = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "opt.m.w": np.zeros((2, 3), np.float32)}
    files = set()
    for i in range(12):
        save_checkpoint(tmp_path / f"c{i}", tensors, {"step": 1})
        files.add((tmp_path / f"c{i}" / "model.safetensors").read_bytes())
        assert load_checkpoint(tmp_path / f"c{i}")[1] == {"step": 1}
    assert len(files) == 1


def test_weights_stored_as_integers_are_refused_by_name(tmp_path):
    """A (hand-made) checkpoint of int32 weights loaded without a word, and a run on it
    trained nothing."""
    from forge_ml.inference.load import load_model
    from forge_ml.models.gpt2 import GPT2, GPT2Config
    cfg = GPT2Config(vocab_size=4, block_size=8, n_layer=1, n_head=1, n_embd=8)
    state = GPT2.init(cfg).state_dict()
    state["wte.weight"] = state["wte.weight"].astype(np.int32)
    save_checkpoint(tmp_path / "c", state, {"config": cfg.to_dict(), "tokenizer": {"kind": "char", "chars": "abc\n"}})
    with pytest.raises(CheckpointError, match=r"1 not floating point: wte.weight \(int32\)"):
        load_model(tmp_path / "c")


def test_save_and_load_refuse_what_would_not_load_or_is_no_path(tmp_path):
    """(QA of the Python API) a tensor named __metadata__ (safetensors' header key) replaced a
    good checkpoint with one that could not be read; None as the folder was Python's TypeError;
    a meta whose config is not an object was a ValueError from dict()."""
    from forge_ml.inference import load_model
    d = tmp_path / "c"
    save_checkpoint(d, {"w": np.ones(3, np.float32)}, {"v": 1})
    with pytest.raises(CheckpointError, match="__metadata__ is safetensors' reserved header name"):
        save_checkpoint(d, {"__metadata__": np.ones(3, np.float32)}, {"v": 2})
    assert load_checkpoint(d)[1] == {"v": 1}                        # the good one kept
    for call in (lambda: load_checkpoint(None), lambda: save_checkpoint(None, {}, {})):
        with pytest.raises(CheckpointError, match="must be a path .*got NoneType"):
            call()
    save_checkpoint(d, {"w": np.ones(3, np.float32)}, {"config": "x"})
    with pytest.raises(CheckpointError, match="no model 'config' .*got str"):
        load_model(d)


def test_a_save_to_the_current_folder_or_a_parent_is_refused(tmp_path, monkeypatch):
    """A QA report: save_checkpoint(".") (and save_hf_gpt2("")) swapped the process's current
    folder away: os.getcwd() then raised FileNotFoundError."""
    from forge_ml.hf import gpt2_param_shapes, save_hf_gpt2
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for p in (".", str(work), "..", str(tmp_path)):
        with pytest.raises(CheckpointError, match="is or holds the current folder"):
            save_checkpoint(p, make_tensors(), make_meta())
    cfg = dict(vocab_size=8, block_size=8, n_layer=1, n_head=1, n_embd=4)
    params = {k: np.zeros(s, np.float32) for k, s in gpt2_param_shapes(cfg).items()}
    with pytest.raises(CheckpointError, match="must be a path"):       # "" is none
        save_hf_gpt2("", cfg, params)
    with pytest.raises(CheckpointError, match="is or holds the current folder"):
        save_hf_gpt2(".", cfg, params)
    assert os.getcwd() == str(work) and os.listdir(work) == []


def test_a_replaced_folder_keeps_its_mode(tmp_path):
    """A QA report: the swap put a new folder in place of the old one (an empty one given as
    --out, or an earlier output), its mode (a setgid bit, a group's access) lost."""
    import stat
    d = tmp_path / "ckpt"
    d.mkdir()
    os.chmod(d, 0o2750)
    save_checkpoint(d, make_tensors(0), make_meta(1))
    assert stat.S_IMODE(d.stat().st_mode) == 0o2750
    os.chmod(d, 0o700)
    save_checkpoint(d, make_tensors(1), make_meta(2))
    assert stat.S_IMODE(d.stat().st_mode) == 0o700 and load_checkpoint(d)[1]["step"] == 2


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes anywhere")
def test_an_empty_read_only_folder_is_refused_not_replaced(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    os.chmod(d, 0o555)
    try:
        with pytest.raises(CheckpointError, match=r"ro is read-only \(dr-xr-xr-x\)"):
            save_checkpoint(d, make_tensors(), make_meta())
        assert d.is_dir() and os.listdir(d) == []
    finally:
        os.chmod(d, 0o755)


def test_a_path_through_a_file_is_named(tmp_path):
    """A QA report: --out afile/sub (afile a file) said "File exists (.../afile)"."""
    (tmp_path / "afile").write_text("mine")
    for p in ("afile/sub", "afile/sub/deeper"):
        with pytest.raises(CheckpointError, match=r"afile is a file, not a folder"):
            save_checkpoint(tmp_path / p, make_tensors(), make_meta())
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_name_near_the_length_limit_is_saved_and_replaced(tmp_path):
    """A QA report: a 252-character folder name failed with "File name too long" naming its
    .old path, which the user never gave; the swap's names beside it are hashed there."""
    d = tmp_path / ("a" * 252)
    save_checkpoint(d, make_tensors(0), make_meta(1))
    save_checkpoint(d, make_tensors(1), make_meta(2))
    assert load_checkpoint(d)[1]["step"] == 2 and os.listdir(tmp_path) == [d.name]
