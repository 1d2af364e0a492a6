"""The inference library used as an application embeds it: ``load_model``'s errors for a
damaged checkpoint (one CheckpointError naming the folder), its ``tokenizer=False``, and the
engine's refusal of prompts that are no sequence of ids (``check_prompt``)."""
import numpy as np
import pytest

import forge_ml as fm
from forge_ml.checkpoint import save_checkpoint
from forge_ml.errors import CheckpointError
from forge_ml.inference import load_model
from forge_ml.inference.batch import BatchEngine
from forge_ml.inference.engine import RequestError, SamplingParams, check_prompt
from forge_ml.models.gpt2 import GPT2, GPT2Config

CFG = GPT2Config(vocab_size=11, block_size=16, n_layer=2, n_head=2, n_embd=8)


def _checkpoint(folder, config=None, tokenizer=None):
    meta = {"config": CFG.to_dict() if config is None else config, "step": 1,
            "tokenizer": tokenizer or {"kind": "char", "chars": "abcdefghij\n"}}
    save_checkpoint(str(folder), GPT2.init(CFG).state_dict(), meta)
    return folder


@pytest.mark.parametrize("change, said", [
    ({"n_embd": 16}, "do not match"),          # weights of another width
    ({"n_layer": 1}, "do not match"),          # a layer the config does not have
    ({"n_head": 3}, "not valid"),              # 8 channels do not split into 3 heads
    ({"vocab_size": "11"}, "not valid"),
    ({"bogus": 1}, "not valid"),
])
def test_a_checkpoint_whose_config_does_not_fit_is_a_checkpoint_error_naming_it(tmp_path, change,
                                                                                 said):
    # these were a ConfigError or a CheckpointError that named no file ("GPT2Config: n_embd 8
    # must be divisible by n_head 3", "checkpoint does not fit the model: ...")
    d = _checkpoint(tmp_path / "ck", dict(CFG.to_dict(), **change))
    with pytest.raises(CheckpointError, match=said) as e:
        load_model(d)
    assert str(d) in str(e.value)
    run = tmp_path / "run"       # a run folder: its ckpt/ named
    _checkpoint(run / "ckpt", dict(CFG.to_dict(), **change))
    with pytest.raises(CheckpointError) as e:
        load_model(run)
    assert str(run / "ckpt") in str(e.value)


def test_a_sound_checkpoint_still_loads(tmp_path):
    model, tok, meta = load_model(_checkpoint(tmp_path / "ck"), dtype="float64")
    assert model.config == CFG and model.dtype == fm.float64 and tok.vocab_size == 11


def test_tokenizer_false_gives_none_for_a_checkpoints_unreadable_tokenizer(tmp_path):
    # as for a Hugging Face folder: token ids alone (eval of a shard) need no tokenizer, and
    # the checkpoint's unreadable record stopped the load
    d = _checkpoint(tmp_path / "ck", tokenizer={"kind": "char"})     # no 'chars'
    with pytest.raises(CheckpointError, match="tokenizer") as e:
        load_model(d)
    assert str(d) in str(e.value)
    model, tok, meta = load_model(d, tokenizer=False)
    assert tok is None and meta["tokenizer"] is None and model.config == CFG


@pytest.mark.parametrize("prompt", [np.array(3), {1, 2, 3}, {3: 0, 1: 0}, fm.tensor(np.array(3))],
                         ids=["0-d array", "set", "dict", "0-d tensor"])
def test_a_prompt_that_is_no_sequence_of_ids_is_a_request_error(prompt):
    # a 0-d array raised "TypeError: iteration over a 0-d array"; a set or a dict was taken
    # in its own order (a dict's keys as the prompt) in silence
    with pytest.raises(RequestError, match="list of int token ids") as e:
        check_prompt(prompt, SamplingParams(max_tokens=1), vocab_size=11, max_len=16)
    assert e.value.param == "prompt"


def test_the_engine_refuses_such_a_prompt_and_serves_the_next():
    with BatchEngine(GPT2.init(CFG), slots=2) as engine:
        for prompt in (np.array(3), {4, 2}):
            with pytest.raises(RequestError):
                engine.submit(prompt, SamplingParams(max_tokens=2))
        # an array of ids and an iterator still are prompts
        out = [t.token for t in engine.submit(np.array([4, 2]), SamplingParams(max_tokens=2))]
        again = [t.token for t in engine.submit(iter([4, 2]), SamplingParams(max_tokens=2))]
        assert len(out) == 2 and out == again and engine.running


def test_decode_step_choose_takes_a_prefills_last_logits_only():
    """DecodeStep.choose reshaped whatever came to (B, -1): a prefill's whole (1, T, Vp) output
    chose from position 0's logits, in silence; (1, Vp) given to a 2-row step split the row in
    two. Both are a ShapeError naming the shapes; the last position's logits choose as before."""
    import numpy as np

    import forge_ml as fm
    from forge_ml.errors import ShapeError
    from forge_ml.inference.decode import DecodeStep
    from test_generate import make_model
    m = make_model()
    c = m.new_cache(1, 24)
    step = DecodeStep(m, c)
    full = m.forward_cached(fm.tensor([[3, 1, 4]]), c)
    with pytest.raises(ShapeError, match=r"logits must be \(1, Vp\) or \(1, 1, Vp\)"):
        step.choose(full, 3)
    last = full.numpy()[:, -1:, :]
    want = int(np.argmax(last[0, 0, :m.config.vocab_size]))
    assert step.choose(fm.tensor(last), 3).tolist() == [want]
    two = DecodeStep(m, m.new_cache(2, 24))
    with pytest.raises(ShapeError, match=r"got \(1, "):
        two.choose(fm.tensor(last[0]), 3)
