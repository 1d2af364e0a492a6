"""What a notebook user of the library met in a QA run (2026-12-06): the same value in the forms
the library's own functions give it (a forge-ml tensor of ids, a list of stop ids, top_k 0 or
None for "off"), a mistyped config field, train(until=...) past max_steps. Each test fails on
the code before."""
import numpy as np
import pytest

import forge_ml as fm
from forge_ml.errors import ConfigError
from forge_ml.inference import BatchEngine, beam_search, generate
from forge_ml.inference.engine import SamplingParams
from forge_ml.models.gpt2 import GPT2, GPT2Config
from forge_ml.tokenizer import CharTokenizer

CFG = GPT2Config(vocab_size=11, block_size=16, n_layer=1, n_head=1, n_embd=8)


@pytest.fixture(scope="module")
def model():
    return GPT2.init(CFG, seed=1)


def test_top_k_zero_is_off_as_none_in_every_api(model):
    """generate refused top_k=0 ("None or >= 1") where SamplingParams refused None ("0 is off")."""
    a = list(generate(model, [1, 2], max_new_tokens=6, temperature=1.0, top_k=None, seed=5))
    b = list(generate(model, [1, 2], max_new_tokens=6, temperature=1.0, top_k=0, seed=5))
    assert a == b
    assert SamplingParams(top_k=None) == SamplingParams(top_k=0)
    with pytest.raises(ConfigError, match="top_k must be None or an int >= 0"):
        list(generate(model, [1], top_k=-1))


def test_forge_ml_sample_takes_top_k_zero_as_off(tmp_path, capsys):
    """--top-k 0 was "must be >= 1", where generate now takes 0 as off (transformers' 0)."""
    from forge_ml.checkpoint import save_checkpoint
    from forge_ml.cli import main
    chars = "abcdefghijk"
    save_checkpoint(tmp_path / "ck", GPT2.init(CFG, seed=1).state_dict(),
                    {"config": CFG.to_dict(), "tokenizer": {"kind": "char", "chars": chars}, "step": 1})
    outs = []
    for k in ([], ["--top-k", "0"]):
        assert main(["sample", "--ckpt", str(tmp_path / "ck"), "--prompt", "abc", "--max-new-tokens", "8",
                     "--seed", "3", *k]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    assert main(["sample", "--ckpt", str(tmp_path / "ck"), "--top-k", "-1"]) == 2
    assert "--top-k must be >= 0 (0 is off), got -1" in capsys.readouterr().err


def test_stop_tokens_as_a_list_and_ids_as_a_tensor(model):
    """SamplingParams took stop_tokens only as a tuple (generate takes a list); beam_search and
    a tokenizer's decode refused a forge-ml tensor of ids (generate takes one)."""
    assert SamplingParams(stop_tokens=[1, 2]).stop_tokens == (1, 2)
    prompt = fm.tensor(np.array([4, 2, 7], np.int32))
    assert beam_search(model, prompt, 4, 2) == beam_search(model, [4, 2, 7], 4, 2)
    tok = CharTokenizer("abcdefghijk")
    assert tok.decode(fm.tensor(np.array([0, 1, 2], np.int32))) == "abc"
    assert BatchEngine is not None   # importable from forge_ml.inference, as generate is


def test_from_state_dict_takes_the_models_own_tensors(model):
    """It took NumPy arrays and torch tensors, and forge-ml's own tensors (model.params) were a
    'float() argument must be ... not Tensor' TypeError."""
    again = GPT2.from_state_dict(CFG, dict(model.params))
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(again.params[k].numpy(), v)


def test_a_mistyped_config_field_is_one_config_error():
    with pytest.raises(ConfigError, match="vocab_size must be a positive int, got '11'"):
        GPT2Config(vocab_size="11", block_size=16, n_layer=1, n_head=1, n_embd=8)


def test_train_until_past_max_steps_is_refused(tmp_path):
    """It was cut to max_steps without a word (and at max_steps ran nothing, returning a summary
    as if done: loss None)."""
    from forge_ml.train import TrainConfig, Trainer
    text = tmp_path / "t.txt"
    text.write_text("hello world, " * 300)
    t = Trainer(TrainConfig(data=str(text), out_dir=str(tmp_path / "r"), n_layer=1, n_head=1, n_embd=8,
                            block_size=8, batch_size=2, max_steps=4, eval_interval=0, eval_iters=1,
                            sample_interval=0, checkpoint_interval=0, progress=False), log=None)
    with pytest.raises(ConfigError, match=r"train\(until=9\) is past max_steps 4"):
        t.train(until=9)
    assert t.train(until=4)["step"] == 4
