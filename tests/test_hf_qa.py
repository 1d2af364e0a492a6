"""QA of the Hugging Face interchange and the checkpoints as a new user meets them:
``forge-ml convert`` both ways, ``forge_ml.hf`` and ``forge_ml.checkpoint`` given odd input."""
import json

import numpy as np
import pytest

from forge_ml.checkpoint import load_checkpoint, save_checkpoint
from forge_ml.cli import main
from forge_ml.errors import CheckpointError
from forge_ml.hf import gpt2_param_shapes, hf_meta, load_hf_flags, load_hf_gpt2, save_hf_gpt2
from forge_ml.models.gpt2 import GPT2, GPT2Config

CFG = {"vocab_size": 10, "block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 4}


def params(cfg=CFG, seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in gpt2_param_shapes(cfg).items()}


def char_checkpoint(path, **meta):
    """A small forge-ml model checkpoint (as ``convert --from-hf`` writes one), ``meta`` added."""
    cfg = GPT2Config(vocab_size=4, block_size=8, n_layer=1, n_head=1, n_embd=8)
    save_checkpoint(path, GPT2.init(cfg, seed=0).state_dict(),
                    {"kind": "forge-ml-model", "config": cfg.to_dict(),
                     "tokenizer": {"kind": "char", "chars": "abc\n"}, **meta})


@pytest.mark.parametrize("field", ["dropout", "layernorm_eps", "tied_head"])
def test_save_hf_gpt2_takes_an_optional_field_of_none_as_not_given(tmp_path, field):
    """(QA) save_hf_gpt2 checked its config with None taken as a field not given (as for
    padded_vocab_size), then wrote it with float(None): a TypeError for dropout and
    layernorm_eps; a tied_head of None gave an untied head ("1 missing: lm_head.weight")."""
    p = params()
    save_hf_gpt2(tmp_path / "hf", dict(CFG, **{field: None}), p)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["resid_pdrop"], written["layer_norm_epsilon"]) == (0.0, 1e-5)
    assert written["tie_word_embeddings"] is True
    config, back = load_hf_gpt2(tmp_path / "hf")
    assert all(np.array_equal(back[k], p[k]) for k in p)


@pytest.mark.parametrize("field", ["vocab_size", "block_size", "n_layer", "n_embd", "n_head"])
def test_save_hf_gpt2_says_a_required_field_of_none_is_missing(tmp_path, field):
    """(QA) A required size of None was int()'s TypeError (an n_head of None was checked as
    GPT2Config's default 12: "n_embd 4 must be divisible by n_head 12")."""
    with pytest.raises(CheckpointError, match=f"config lacks \\['{field}'\\]"):
        save_hf_gpt2(tmp_path / "hf", dict(CFG, **{field: None}), params())
    assert not (tmp_path / "hf").exists()


def test_convert_to_hf_of_a_recorded_dropout_of_null_exports(tmp_path, capsys):
    """(QA) A checkpoint whose state.json records "dropout": null made ``convert --to-hf``
    end in a TypeError traceback; it exports as a dropout not given (0)."""
    char_checkpoint(tmp_path / "c")
    state = json.loads((tmp_path / "c" / "state.json").read_text())
    state["meta"]["config"]["dropout"] = None
    (tmp_path / "c" / "state.json").write_text(json.dumps(state))
    assert main(["convert", "--to-hf", str(tmp_path / "c"), "--out", str(tmp_path / "hf")]) == 0
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["resid_pdrop"] == 0.0 and written["n_embd"] == 8


@pytest.mark.parametrize("flags", [["reorder_and_upcast_attn"], "yes", 1])
def test_convert_to_hf_of_hf_flags_that_are_no_object_is_a_clear_error(tmp_path, capsys, flags):
    """(QA) A checkpoint whose meta "hf_flags" is a list or a string (a hand-edited state.json)
    made ``convert --to-hf`` end in an AttributeError traceback."""
    char_checkpoint(tmp_path / "c", hf_flags=flags)
    assert main(["convert", "--to-hf", str(tmp_path / "c"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "state.json: expected meta 'hf_flags' to be an object" in err and "Traceback" not in err
    assert repr(flags)[:10] in err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("fn", [hf_meta, load_hf_flags])
@pytest.mark.parametrize("arg", [None, 3, ""])
def test_hf_meta_and_load_hf_flags_refuse_what_is_no_path(fn, arg):
    """(QA) hf_meta and load_hf_flags, unlike load_hf_dropout beside them, met None or an int
    with Python's TypeError from inside pathlib ('' read the current folder's config.json)."""
    with pytest.raises(CheckpointError, match=f"{fn.__name__}: the checkpoint folder must be a path"):
        fn(arg)


@pytest.mark.parametrize("fn", [hf_meta, load_hf_flags])
def test_a_flag_that_is_not_true_or_false_is_refused_not_read_as_true(tmp_path, fn):
    """(QA) load_hf_flags read {"reorder_and_upcast_attn": "false"} as True (bool of a
    non-empty string); load_hf_gpt2 refuses the same config.json."""
    (tmp_path / "config.json").write_text(json.dumps({"reorder_and_upcast_attn": "false"}))
    with pytest.raises(CheckpointError, match="expected true or false for 'reorder_and_upcast_attn', "
                                              "got 'false'"):
        fn(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"reorder_and_upcast_attn": False}))
    assert load_hf_flags(tmp_path) == {"reorder_and_upcast_attn": False}


def test_save_checkpoint_refuses_a_dtype_safetensors_cannot_hold_by_name(tmp_path):
    """(QA) A float128 array passed the dtype check (kind "f") and failed inside safetensors,
    with an error naming the scratch folder ``<dir>.tmp`` the user never gave."""
    if np.dtype(np.longdouble).itemsize <= 8:
        pytest.skip("long double is float64 here")
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(tmp_path / "c", {"w": np.zeros(2, np.longdouble)}, {})
    msg = str(e.value)
    assert msg.startswith(f"save_checkpoint: w has dtype {np.dtype(np.longdouble)};")
    assert ".tmp" not in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    save_checkpoint(tmp_path / "c", {"w": np.ones(2, np.float64)}, {})   # float64 still saves
    assert load_checkpoint(tmp_path / "c")[0]["w"].dtype == np.float64
