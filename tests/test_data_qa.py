"""QA of the data and evaluation path as nanoGPT's and llm.c's users meet it: `forge-ml eval`'s
loss against a direct float64 computation, the loader's paths, and what the commands say."""
import numpy as np

from forge_ml.checkpoint import save_checkpoint
from forge_ml.cli import main
from forge_ml.data import DataLoader, write_shard
from forge_ml.inference import load_model
from forge_ml.models.gpt2 import GPT2, GPT2Config
from forge_ml.tensor import tensor


def reference_loss(ckpt, ids, T: int) -> float:
    """The mean next-token loss of the checkpoint over the whole windows of ``T`` of ``ids``,
    from its logits in float64 (a log-softmax of our own, not the loss op eval uses)."""
    model = load_model(str(ckpt), tokenizer=False)[0].to(dtype="float64")
    ids = np.asarray(ids, np.int64)
    n = (len(ids) - 1) // T
    x = ids[:n * T].reshape(n, T)
    y = ids[1:n * T + 1].reshape(n, T)
    logits = np.asarray(model.logits(tensor(x)).numpy(), np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, y[..., None], -1).mean())


def printed_loss(capsys) -> float:
    out = capsys.readouterr().out
    assert out.startswith("loss "), out
    return float(out.split()[1])


def test_eval_of_a_text_whose_tokenizer_has_more_ids_than_a_shard_holds(tmp_path, capsys):
    """(QA) eval tokenized a text file into a temporary uint16 shard: a checkpoint whose
    tokenizer has more than 65,536 ids (a large char alphabet; a Hugging Face vocabulary) failed
    with "write_shard: token 67951 ... for /tmp/tmpXXXX/eval.bin", a file the user never named.
    The ids stay in memory now, and the loss is the float64 one."""
    chars = "".join(chr(c) for c in range(0x10000, 0x10000 + 66_000))   # (past the surrogates)
    cfg = GPT2Config(vocab_size=len(chars), block_size=16, n_layer=1, n_head=1, n_embd=8)
    save_checkpoint(tmp_path / "big", GPT2.init(cfg, seed=0).state_dict(),
                    {"kind": "forge-ml-train", "config": cfg.to_dict(),
                     "tokenizer": {"kind": "char", "chars": chars}, "step": 1})
    text = (chars[-40:] + chars[:30]) * 2            # ids past 65,535 and below it
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    assert main(["eval", "--ckpt", str(tmp_path / "big"), "--data", str(tmp_path / "t.txt")]) == 0
    ids = load_model(str(tmp_path / "big"))[1].encode(text)
    assert max(ids) >= 65536 and ids[-1] == 29
    assert abs(printed_loss(capsys) - reference_loss(tmp_path / "big", ids, 16)) < 1e-4


def test_a_loader_path_whose_name_holds_glob_characters_is_that_file(tmp_path):
    """(QA) DataLoader("runs/lr[3e-4]/data/val.bin", ...) took the path for a glob pattern:
    "no token shards match the pattern", though the file was there."""
    d = tmp_path / "lr[3e-4]"
    write_shard(d / "val.bin", range(100))
    write_shard(tmp_path / "lr3" / "val.bin", range(500, 600))   # what the pattern matches
    dl = DataLoader(str(d / "val.bin"), 2, 4)
    assert dl.n_tokens == 100 and int(next(dl.eval_batches(1))[0][0, 0]) == 0
    pattern = DataLoader(str(tmp_path / "lr[0-9]" / "val.bin"), 2, 4)   # a pattern still is one
    assert pattern.n_tokens == 100 and int(next(pattern.eval_batches(1))[0][0, 0]) == 500


def test_eval_says_when_a_tenth_or_more_of_the_data_is_short_of_a_window(tmp_path, capsys):
    """eval scores whole windows: 95 tokens in windows of 32 score 64 targets, and the last 30
    (a third of the data) went unsaid; the line now says so, and the loss is the whole
    windows' float64 one. A tail under a tenth of the data stays unmentioned."""
    chars = "abcdefghij"
    cfg = GPT2Config(vocab_size=len(chars), block_size=32, n_layer=1, n_head=1, n_embd=8)
    save_checkpoint(tmp_path / "c", GPT2.init(cfg, seed=1).state_dict(),
                    {"config": cfg.to_dict(), "tokenizer": {"kind": "char", "chars": chars},
                     "step": 1})
    rs = np.random.default_rng(2)
    for n, said in ((95, "; the last 30 tokens, short of a window of 32, are not scored (32% of "
                         "the data)"), (330, "")):
        ids = rs.integers(0, len(chars), n)
        write_shard(tmp_path / f"v{n}.bin", ids)
        assert main(["eval", "--ckpt", str(tmp_path / "c"), "--data",
                     str(tmp_path / f"v{n}.bin")]) == 0
        out = capsys.readouterr().out
        assert out.rstrip("\n").endswith(said) and ("not scored" in out) == bool(said), out
        assert abs(float(out.split()[1]) - reference_loss(tmp_path / "c", ids, 32)) < 1e-4


def test_a_shard_path_that_is_a_pipe_is_named_so(tmp_path):
    """read_shard said "token shard not found" of a FIFO that exists (DataLoader, eval)."""
    import os

    import pytest

    from forge_ml.data import read_shard
    from forge_ml.errors import DataError
    fifo = tmp_path / "val.bin"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="is a special file \\(a pipe or a device\\)"):
        read_shard(fifo)
    with pytest.raises(DataError, match="token shard not found"):
        read_shard(tmp_path / "none.bin")


def test_eval_batches_refuses_a_tail_with_a_count(tmp_path):
    """eval_batches(n, tail=True) gave n whole batches and no smaller last one, in silence."""
    import pytest

    from forge_ml.errors import DataError
    write_shard(tmp_path / "s.bin", range(50))
    dl = DataLoader(tmp_path / "s.bin", 5, 4)
    with pytest.raises(DataError, match="tail=True covers every window and takes n=None; got n=2"):
        list(dl.eval_batches(2, tail=True))
    assert [len(x) for x, _ in dl.eval_batches(2)] == [5, 5]
