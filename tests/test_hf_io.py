"""Hugging Face GPT-2 interchange against transformers' own save_pretrained / from_pretrained."""
import json
import logging
import re
import subprocess
import sys

import numpy as np
import pytest

from forge_ml.checkpoint import load_checkpoint, save_checkpoint
from forge_ml.errors import CheckpointError
from forge_ml.hf import default_padded_vocab, gpt2_param_shapes, load_hf_gpt2, save_hf_gpt2
from test_cli_files import denied_open  # open() refused for one file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

SMALL = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64)


def hf_model(tie=True, seed=0, **over):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(**dict(SMALL, tie_word_embeddings=tie, **over))
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # non-trivial LayerNorm parameters and biases, not just ones/zeros
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def hf_state(model) -> dict:
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "tied"
    model = hf_model()
    model.save_pretrained(d, safe_serialization=True)
    return d, model


def test_module_does_not_import_torch():
    code = "import sys, forge_ml.hf; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_load_matches_state_dict_exactly(saved):
    d, model = saved
    config, params = load_hf_gpt2(d, padded_vocab=128)
    assert config == {   # dropout: transformers' default 0.1 for its three rates
        "vocab_size": 100, "padded_vocab_size": 128, "block_size": 64, "n_layer": 2, "n_head": 2,
        "n_embd": 32, "dropout": 0.1, "tied_head": True, "layernorm_eps": 1e-5,
    }
    want = hf_state(model)
    assert set(params) == {k.removeprefix("transformer.") for k in want} - {"lm_head.weight"}
    for k, a in params.items():
        assert a.dtype == np.float32
        ref = want["transformer." + k]
        if k == "wte.weight":
            assert a.shape == (128, 32)
            np.testing.assert_array_equal(a[:100], ref)
            assert not a[100:].any()  # padded rows are zero
        else:
            assert a.shape == ref.shape, k
            np.testing.assert_array_equal(a, ref)
    assert list(params) == list(gpt2_param_shapes(config))


def test_default_padding_follows_gpt2config(saved):
    assert default_padded_vocab(50257) == 50304
    assert default_padded_vocab(100) == 100
    config, params = load_hf_gpt2(saved[0])
    assert config["padded_vocab_size"] == 100 and params["wte.weight"].shape == (100, 32)
    try:
        from forge_ml.models.gpt2 import GPT2Config
    except ImportError:
        pass
    else:
        for v in (65, 100, 1023, 1024, 50257):
            assert GPT2Config(vocab_size=v).padded_vocab_size == default_padded_vocab(v)
    with pytest.raises(CheckpointError, match="padded_vocab=64 is smaller"):
        load_hf_gpt2(saved[0], padded_vocab=64)


@pytest.mark.parametrize("padded", ["128", 128.5, True])
def test_a_padded_vocab_that_is_not_an_int_is_refused(saved, padded):
    """ "128" was a ValueError of int(), 128.5 padded to 128 and True to 1 (said as "1 is smaller")."""
    with pytest.raises(CheckpointError, match=re.escape(f"padded_vocab: expected an int (or None), got {padded!r}")):
        load_hf_gpt2(saved[0], padded_vocab=padded)


def test_save_reloads_in_transformers_exactly(saved, tmp_path):
    d, model = saved
    config, params = load_hf_gpt2(d, padded_vocab=128)
    out = tmp_path / "export"
    save_hf_gpt2(out, config, params)
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    want, got = hf_state(model), hf_state(reloaded)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    ids = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_round_trip_load_save_load_exact(saved, tmp_path):
    config, params = load_hf_gpt2(saved[0], padded_vocab=128)
    save_hf_gpt2(tmp_path / "a", config, params)
    config2, params2 = load_hf_gpt2(tmp_path / "a", padded_vocab=128)
    assert config2 == config
    assert list(params2) == list(params)
    for k in params:
        np.testing.assert_array_equal(params2[k], params[k])
    # and through a forge-ml checkpoint
    save_checkpoint(tmp_path / "ck", params, {"config": config})
    tensors, meta = load_checkpoint(tmp_path / "ck")
    save_hf_gpt2(tmp_path / "b", meta["config"], tensors)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


DROPOUT_KEYS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout")


@pytest.mark.parametrize("rates, forge_rate", [
    (dict(resid_pdrop=0.05, embd_pdrop=0.15, attn_pdrop=0.25, summary_first_dropout=0.35), 0.05),
    (dict(resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2, summary_first_dropout=0.0), 0.2)])
def test_convert_round_trip_keeps_the_dropout_rates(tmp_path, rates, forge_rate):
    """convert --from-hf, then --to-hf: the export wrote 0 for resid_pdrop, embd_pdrop and
    attn_pdrop and left summary_first_dropout out (transformers' 0.1), so the config came back
    other than given (the weights and logits were the same). A save_pretrained folder's rates,
    three differing ones or one shared, come back as given; forge-ml's one dropout rate is the
    shared one, or resid_pdrop where they differ."""
    from forge_ml.cli import main

    torch.manual_seed(3)
    given_cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=32, vocab_size=50257,
                                        **rates)
    model = transformers.GPT2LMHeadModel(given_cfg).eval()
    model.save_pretrained(tmp_path / "given", safe_serialization=True)
    given = json.loads((tmp_path / "given" / "config.json").read_text())
    assert all(given[k] == v for k, v in rates.items())
    assert main(["convert", "--from-hf", str(tmp_path / "given"), "--out", str(tmp_path / "ck")]) == 0
    assert load_checkpoint(tmp_path / "ck")[1]["config"]["dropout"] == forge_rate
    assert main(["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "back")]) == 0
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: back.get(k) for k in DROPOUT_KEYS} == {k: given[k] for k in DROPOUT_KEYS}
    theirs = transformers.GPT2Config.from_pretrained(tmp_path / "back")
    assert {k: getattr(theirs, k) for k in DROPOUT_KEYS} == rates
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back").eval()
    ids = torch.randint(0, 50257, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_export_of_a_checkpoint_writes_its_dropout_rate(tmp_path):
    """A forge-ml checkpoint (no Hugging Face rates in its meta): convert --to-hf writes the
    dropout rate its config records as HF's three (it wrote 0: the model loaded for the export
    has none), and transformers' default summary_first_dropout."""
    from forge_ml.cli import main
    from forge_ml.models.gpt2 import GPT2, GPT2Config

    cfg = GPT2Config(vocab_size=50257, block_size=16, n_layer=1, n_head=2, n_embd=8, dropout=0.2)
    save_checkpoint(tmp_path / "ck", GPT2.init(cfg, seed=0).state_dict(),
                    {"config": cfg.to_dict(), "tokenizer": {"kind": "gpt2"}})
    assert main(["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    back = transformers.GPT2Config.from_pretrained(tmp_path / "hf")
    assert {k: getattr(back, k) for k in DROPOUT_KEYS} == dict(
        resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2, summary_first_dropout=0.1)


def test_a_loaded_hugging_face_folder_has_no_dropout(tmp_path):
    """load_model of a Hugging Face folder gives a model without dropout, as of a checkpoint
    (model.forward(tape, x) trains by default: a loaded GPT-2 dropped 10% of its activations);
    its rates stay in the meta, which convert --to-hf writes back."""
    from forge_ml.cli import main
    from forge_ml.inference import load_model

    model = hf_model(resid_pdrop=0.1, embd_pdrop=0.2, attn_pdrop=0.3)
    model.save_pretrained(tmp_path / "given", safe_serialization=True)
    ours, _, meta = load_model(tmp_path / "given")
    assert ours.config.dropout == 0.0
    assert meta["config"]["dropout"] == 0.1
    assert main(["convert", "--to-hf", str(tmp_path / "given"), "--out", str(tmp_path / "back")]) == 0
    back = transformers.GPT2Config.from_pretrained(tmp_path / "back")
    assert {k: getattr(back, k) for k in DROPOUT_KEYS} == dict(
        resid_pdrop=0.1, embd_pdrop=0.2, attn_pdrop=0.3, summary_first_dropout=0.1)


def test_reorder_and_upcast_attn_survives_a_round_trip(tmp_path):
    """A folder with reorder_and_upcast_attn true (transformers upcasts the attention scores in
    half precision; float32 computes alike): convert --from-hf then --to-hf, and convert --to-hf
    of the folder itself, write it back true (an export wrote false), with the same logits."""
    from forge_ml.cli import main

    model = hf_model(reorder_and_upcast_attn=True, vocab_size=50257, n_embd=8, n_layer=1)
    model.save_pretrained(tmp_path / "given", safe_serialization=True)   # GPT-2's vocabulary
    assert main(["convert", "--from-hf", str(tmp_path / "given"), "--out", str(tmp_path / "fm")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "fm"), "--out", str(tmp_path / "back")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "given"), "--out", str(tmp_path / "back2")]) == 0
    ids = torch.tensor([[1, 5, 9, 2]])
    for d in ("back", "back2"):
        assert transformers.GPT2Config.from_pretrained(tmp_path / d).reorder_and_upcast_attn is True
        again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / d).eval()
        with torch.no_grad():
            torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
    plain = hf_model()
    plain.save_pretrained(tmp_path / "plain", safe_serialization=True)
    assert main(["convert", "--to-hf", str(tmp_path / "plain"), "--out", str(tmp_path / "p2")]) == 0
    assert transformers.GPT2Config.from_pretrained(tmp_path / "p2").reorder_and_upcast_attn is False
    cfg = {"vocab_size": 5, "block_size": 4, "n_layer": 1, "n_head": 1, "n_embd": 2}
    zeros = {k: np.zeros(sh, np.float32) for k, sh in gpt2_param_shapes(cfg).items()}
    with pytest.raises(CheckpointError, match="hf_flags must be a dict"):
        save_hf_gpt2(tmp_path / "x", cfg, zeros, hf_flags={"reorder_and_upcast_attn": "yes"})


def test_written_files_look_like_save_pretrained(saved, tmp_path):
    d, _ = saved
    config, params = load_hf_gpt2(d)
    save_hf_gpt2(tmp_path / "x", config, params)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "x" / "model.safetensors"), "np") as f, \
            safe_open(str(d / "model.safetensors"), "np") as g:
        assert sorted(f.keys()) == sorted(g.keys())
        assert f.metadata() == {"format": "pt"}
    ours = json.loads((tmp_path / "x" / "config.json").read_text())
    theirs = json.loads((d / "config.json").read_text())
    for key in ("model_type", "architectures", "activation_function", "n_embd", "n_head", "n_layer",
                "n_positions", "vocab_size", "layer_norm_epsilon", "tie_word_embeddings"):
        assert ours[key] == theirs[key], key


def test_an_export_writes_every_key_of_transformers_gpt2config(saved, tmp_path):
    """An import then an export dropped summary_type, summary_use_proj, summary_activation,
    summary_proj_to_labels (the settings of GPT2DoubleHeadsModel's summary head, which forge-ml
    has no weights for) and add_cross_attention (which the import refuses true): config.json
    now has every key of transformers' GPT2Config, those with transformers' defaults (what
    transformers reads where a key is absent, so the model loads the same), and every key
    save_pretrained writes but its version mark. The weights are the same bytes."""
    d, model = saved
    config, params = load_hf_gpt2(d)
    save_hf_gpt2(tmp_path / "x", config, params)
    ours = json.loads((tmp_path / "x" / "config.json").read_text())
    defaults = transformers.GPT2Config().to_dict()
    gpt2_keys = set(defaults) - set(transformers.PretrainedConfig().to_dict())
    assert gpt2_keys <= set(ours), sorted(gpt2_keys - set(ours))
    heads = ("summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
             "summary_first_dropout", "add_cross_attention", "pad_token_id")
    assert {k: ours[k] for k in heads} == {k: defaults[k] for k in heads}
    written = set(json.loads((d / "config.json").read_text())) - {"transformers_version"}
    assert written <= set(ours), sorted(written - set(ours))
    theirs = transformers.GPT2Config.from_pretrained(tmp_path / "x")
    assert {k: getattr(theirs, k) for k in heads} == {k: defaults[k] for k in heads}
    save_hf_gpt2(tmp_path / "y", config, params)
    assert (tmp_path / "x" / "model.safetensors").read_bytes() == (tmp_path / "y" / "model.safetensors").read_bytes()
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "x").eval()
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_untied_head(tmp_path):
    model = hf_model(tie=False, seed=1)
    d = tmp_path / "untied"
    model.save_pretrained(d, safe_serialization=True)
    config, params = load_hf_gpt2(d, padded_vocab=128)
    assert config["tied_head"] is False
    want = hf_state(model)
    np.testing.assert_array_equal(params["lm_head.weight"][:100], want["lm_head.weight"])
    assert not params["lm_head.weight"][100:].any()
    assert not np.array_equal(params["lm_head.weight"][:100], params["wte.weight"][:100])
    save_hf_gpt2(tmp_path / "out", config, params)
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    got = hf_state(reloaded)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_a_tied_config_with_another_stored_head_is_refused(saved, tmp_path):
    """tie_word_embeddings true and a stored lm_head.weight unlike wte: the loader dropped the
    head silently (logits off by up to 35 against transformers 5, which keeps the stored head;
    transformers 4 keeps wte). Such a folder is refused; one whose stored head equals wte loads."""
    from safetensors.numpy import load_file, save_file

    d, model = saved
    state = {k: v.copy() for k, v in load_file(str(d / "model.safetensors")).items()}
    wte = next(k for k in state if k.endswith("wte.weight"))
    for name, head, ok in (("same", state[wte].copy(), True),
                           ("other", state[wte] + np.float32(0.5), False)):
        out = tmp_path / name
        out.mkdir()
        (out / "config.json").write_text((d / "config.json").read_text())
        save_file(dict(state, **{"lm_head.weight": head}), str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        if ok:
            assert load_hf_gpt2(out)[0]["tied_head"] is True
        else:
            with pytest.raises(CheckpointError, match="tie_word_embeddings .* lm_head.weight that differs"):
                load_hf_gpt2(out)


def test_a_tied_model_saved_with_safetensors_save_model_keeps_its_embedding(saved, tmp_path):
    """safetensors.torch.save_model writes a tied pair under its first name, lm_head.weight, and
    no wte: transformers loads it (wte is the head); it was refused as "missing: wte.weight"."""
    from safetensors.torch import save_model

    d, model = saved
    out = tmp_path / "save_model"
    out.mkdir()
    (out / "config.json").write_text((d / "config.json").read_text())
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})
    config, params = load_hf_gpt2(out)
    np.testing.assert_array_equal(params["wte.weight"], hf_state(model)["transformer.wte.weight"])
    assert config["tied_head"] and "lm_head.weight" not in params


def test_old_style_keys_without_prefix_and_buffers(saved, tmp_path):
    """Checkpoints like the original openai-community/gpt2 upload: no "transformer." prefix,
    attn.bias / attn.masked_bias buffers, lm_head stored though tied, float16 weights."""
    from safetensors.numpy import save_file

    d, model = saved
    want = hf_state(model)
    tensors = {k.removeprefix("transformer."): v.astype(np.float16) for k, v in want.items()}
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
        tensors[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    out = tmp_path / "old"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((d / "config.json").read_text())
    _, params = load_hf_gpt2(out, padded_vocab=100)
    for k, a in params.items():
        np.testing.assert_array_equal(a, want["transformer." + k].astype(np.float16).astype(np.float32))


def test_bfloat16_weights(saved, tmp_path):
    from safetensors.torch import save_file

    d, model = saved
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    out = tmp_path / "bf16"
    out.mkdir()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((d / "config.json").read_text())
    _, params = load_hf_gpt2(out, padded_vocab=100)
    for k, a in params.items():
        np.testing.assert_array_equal(a, sd["transformer." + k].float().numpy())


# ---------------------------------------------------------------------------------------------
# Errors


def test_other_architecture_is_an_error(saved, tmp_path):
    d, _ = saved
    bad = tmp_path / "llama"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    cfg = json.loads((d / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, model_type="llama", architectures=["LlamaForCausalLM"])))
    with pytest.raises(CheckpointError, match="unknown architecture: model_type is 'llama'"):
        load_hf_gpt2(bad)


@pytest.mark.parametrize("over,match", [
    ({"activation_function": "relu"}, "activation_function='relu'"),
    ({"n_inner": 64}, "n_inner=64"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
])
def test_unsupported_gpt2_variants(saved, tmp_path, over, match):
    d, _ = saved
    bad = tmp_path / "variant"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    cfg = json.loads((d / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, **over)))
    with pytest.raises(CheckpointError, match=match):
        load_hf_gpt2(bad)


def test_transformers_other_names_of_the_sizes_are_read_as_it_reads_them(saved, tmp_path):
    """GPT2Config's attribute_map: num_attention_heads beside n_head is the head count
    transformers runs; it was ignored (another head count, other logits, no word said)."""
    d, model = saved
    cfg = json.loads((d / "config.json").read_text())
    alias = tmp_path / "alias"
    alias.mkdir()
    (alias / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    (alias / "config.json").write_text(json.dumps(dict(cfg, num_attention_heads=4)))
    with pytest.raises(CheckpointError, match=r"n_head=2 but num_attention_heads=4 .*expected one value"):
        load_hf_gpt2(alias)
    renamed = {k: v for k, v in cfg.items() if k not in ("n_embd", "n_head", "n_layer", "n_positions")}
    (alias / "config.json").write_text(json.dumps(dict(renamed, hidden_size=32, num_attention_heads=4,
                                                       num_hidden_layers=2, max_position_embeddings=64)))
    config, _ = load_hf_gpt2(alias)    # only the other names: transformers' 4 heads
    assert (config["n_embd"], config["n_head"], config["n_layer"], config["block_size"]) == (32, 4, 2, 64)
    assert transformers.GPT2LMHeadModel.from_pretrained(alias).config.n_head == 4


@pytest.mark.parametrize("over,match", [
    ({"layer_norm_epsilon": None}, "number >= 0 for 'layer_norm_epsilon', got None"),
    ({"layer_norm_epsilon": "1e-5"}, "number >= 0 for 'layer_norm_epsilon', got '1e-5'"),
    ({"layer_norm_epsilon": float("nan")}, "number >= 0 for 'layer_norm_epsilon', got nan"),
    ({"layer_norm_epsilon": -1e-5}, "number >= 0 for 'layer_norm_epsilon', got -1e-05"),
    ({"tie_word_embeddings": "false"}, "true or false for 'tie_word_embeddings', got 'false'"),
    ({"scale_attn_weights": None}, "true or false for 'scale_attn_weights', got None"),
    ({"n_layer": True}, "positive integer 'n_layer', got True"),
    ({"attn_pdrop": "0.1"}, "number in [0, 1] for 'attn_pdrop', got '0.1'"),
    ({"summary_first_dropout": 1.5}, "number in [0, 1] for 'summary_first_dropout', got 1.5"),
    ({"resid_pdrop": None}, "number in [0, 1] for 'resid_pdrop', got None"),
])
def test_malformed_config_values_are_clear_errors(saved, tmp_path, over, match):
    """Not a TypeError from float(None), nor the string "false" read as true."""
    d, _ = saved
    bad = tmp_path / "malformed"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    cfg = json.loads((d / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, **over)))
    with pytest.raises(CheckpointError, match=re.escape(match)):
        load_hf_gpt2(bad)


def test_a_forge_ml_checkpoint_given_as_a_hugging_face_folder_points_to_to_hf(tmp_path):
    """convert --from-hf on a checkpoint or a run folder (the other direction): not just
    "config.json is missing"."""
    cfg = dict(vocab_size=4, block_size=8, n_layer=1, n_head=1, n_embd=4)
    params = {k: np.zeros(s, np.float32) for k, s in gpt2_param_shapes(cfg).items()}
    save_checkpoint(tmp_path / "run" / "ckpt", params, {"config": cfg})
    for d in (tmp_path / "run", tmp_path / "run" / "ckpt"):
        with pytest.raises(CheckpointError, match=rf"{d} is a forge-ml checkpoint .* convert --to-hf {d} "):
            load_hf_gpt2(d)


def test_a_run_folder_with_a_config_json_of_the_users_is_still_a_run(tmp_path):
    """A config.json of the user's (their settings) beside ckpt/ made sample, serve and convert
    --to-hf read the run as a Hugging Face folder: "model_type is None"."""
    from forge_ml.inference.load import load_model, resolve_checkpoint
    cfg = dict(vocab_size=4, padded_vocab_size=4, block_size=8, n_layer=1, n_head=1, n_embd=4)
    params = {k: np.zeros(s, np.float32) for k, s in gpt2_param_shapes(cfg).items()}
    save_checkpoint(tmp_path / "run" / "ckpt", params, {"config": cfg, "tokenizer": {"kind": "char", "chars": "abcd"}})
    (tmp_path / "run" / "config.json").write_text(json.dumps({"lr": 1e-3}))
    assert resolve_checkpoint(tmp_path / "run") == tmp_path / "run" / "ckpt"
    assert load_model(tmp_path / "run")[0].config.n_embd == 4
    (tmp_path / "hf").mkdir()          # a Hugging Face folder without weights: said so, as before
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert resolve_checkpoint(tmp_path / "hf") == tmp_path / "hf"


def test_shape_mismatch_and_missing_files(saved, tmp_path):
    d, _ = saved
    bad = tmp_path / "mismatch"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    cfg = json.loads((d / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, n_layer=3)))
    with pytest.raises(CheckpointError, match=r"12 missing: h\.2\.ln_1\.weight"):
        load_hf_gpt2(bad)
    (bad / "config.json").write_text(json.dumps(dict(cfg, n_positions=128)))
    with pytest.raises(CheckpointError, match=r"wpe\.weight: checkpoint has \(64, 32\), model expects \(128, 32\)"):
        load_hf_gpt2(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="bad JSON"):
        load_hf_gpt2(bad)
    (bad / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        load_hf_gpt2(bad)
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{trunc")
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        load_hf_gpt2(bad)
    (bad / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors is missing"):
        load_hf_gpt2(bad)
    with pytest.raises(CheckpointError, match="not found"):
        load_hf_gpt2(tmp_path / "nope")


@pytest.mark.parametrize("name", ["pytorch_model.bin", "pytorch_model.bin.index.json"])
def test_pytorch_pickle_weights_name_the_way_to_safetensors(saved, tmp_path, name):
    d = tmp_path / "bin"
    d.mkdir()
    (d / "config.json").write_text((saved[0] / "config.json").read_text())
    (d / name).write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match=rf"found {re.escape(name)}: .*save_pretrained\(new_dir"):
        load_hf_gpt2(d)


def test_sharded_weights_load_and_a_bad_index_is_a_clear_error(saved, tmp_path):
    """save_pretrained's shards (model.safetensors.index.json) load as the one file does; an
    index naming a shard by a number was a TypeError traceback from convert."""
    d, model = saved
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    config, params = load_hf_gpt2(sharded)
    want = load_hf_gpt2(d)[1]
    assert set(params) == set(want) and all(np.array_equal(params[k], want[k]) for k in want)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    for shard in (5, None, ""):
        bad = dict(index, weight_map=dict(index["weight_map"], **{"transformer.wte.weight": shard}))
        (sharded / "model.safetensors.index.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=re.escape(f"a safetensors file for each tensor, got {shard!r} "
                                                            f"for 'transformer.wte.weight'")):
            load_hf_gpt2(sharded)


def test_save_rejects_wrong_params(saved, tmp_path):
    config, params = load_hf_gpt2(saved[0], padded_vocab=128)
    broken = dict(params)
    broken["h.1.mlp.c_fc.weight"] = np.zeros((128, 32), np.float32)
    del broken["ln_f.bias"]
    with pytest.raises(CheckpointError, match=r"ln_f\.bias.*h\.1\.mlp\.c_fc\.weight: checkpoint has \(128, 32\)"):
        save_hf_gpt2(tmp_path / "x", config, broken)
    assert not (tmp_path / "x").exists()
    with pytest.raises(CheckpointError, match="lacks"):
        save_hf_gpt2(tmp_path / "x", {"vocab_size": 100}, params)


@pytest.mark.parametrize("over, match", [
    ({"n_head": 3}, "n_embd 4 must be divisible by n_head 3"),
    ({"n_head": 0}, "n_head must be a positive int, got 0"),
    ({"vocab_size": 0, "padded_vocab_size": 10}, "vocab_size must be a positive int, got 0"),
    ({"n_layer": 1.5}, "n_layer must be a positive int, got 1.5"),
    ({"tied_head": "false"}, "tied_head must be True or False, got 'false'"),
    ({"dropout": "x"}, "dropout must be a number in [0, 1) (as a float32), got 'x'"),
    ("complex", "wte.weight has dtype complex64; expected floating point"),
    ("list", "params must be a dict of NumPy arrays, got list"),
])
def test_save_refuses_a_config_or_params_nothing_would_load(tmp_path, over, match):
    """n_head 3 of n_embd 4 (or 0, or a vocabulary of 0) wrote a folder that neither transformers
    nor load_hf_gpt2 loads; "false" wrote a tied model, 1.5 layers one, complex weights lost
    their imaginary part, a list was an AttributeError."""
    cfg = {"vocab_size": 10, "block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 4}
    params = {k: np.ones(s, np.float32) for k, s in gpt2_param_shapes(cfg).items()}
    if over == "complex":
        params["wte.weight"] = params["wte.weight"] + 1j
    elif over == "list":
        params = list(params.values())
    else:
        cfg = dict(cfg, **over)
    with pytest.raises(CheckpointError, match=re.escape(match)):
        save_hf_gpt2(tmp_path / "x", cfg, params)
    assert not (tmp_path / "x").exists()


def test_save_accepts_gpt2config_dataclass(saved, tmp_path):
    gpt2 = pytest.importorskip("forge_ml.models.gpt2")
    config, params = load_hf_gpt2(saved[0])
    cfg = gpt2.GPT2Config.from_dict(config)
    save_hf_gpt2(tmp_path / "x", cfg, params)
    config2, params2 = load_hf_gpt2(tmp_path / "x")
    assert config2 == config
    for k in params:
        np.testing.assert_array_equal(params2[k], params[k])


@pytest.mark.parametrize("tokenizer, text", [
    ({"kind": "gpt2"}, "Hello world, it's  a test.\n\u00e9 \u65e5\u672c"),
    ({"kind": "char", "chars": "\n !,.:?EGIMORiorst"}, "ROMEO:\nGo, sir. Is it?"),
])
def test_an_export_carries_its_tokenizer_for_transformers(tmp_path, tokenizer, text):
    """AutoTokenizer and pipeline("text-generation") on an exported folder, offline: the ids of
    forge-ml's tokenizer, and the greedy text of forge-ml's generate. (Without tokenizer files
    transformers builds an empty GPT-2 tokenizer: every text is no ids at all.)"""
    from forge_ml.inference import generate
    from forge_ml.models.gpt2 import GPT2, GPT2Config
    from forge_ml.tokenizer import tokenizer_from_dict

    tok = tokenizer_from_dict(tokenizer)
    cfg = GPT2Config(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=16)
    model = GPT2.init(cfg, seed=1)
    save_hf_gpt2(tmp_path / "x", cfg, model.state_dict(), tokenizer=tokenizer)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "x")
    ids = tok.encode(text)
    assert len(hf_tok) == tok.vocab_size
    assert hf_tok(text).input_ids == ids
    assert hf_tok.decode(ids) == text
    pipe = transformers.pipeline("text-generation", model=str(tmp_path / "x"))
    got = pipe(text, max_new_tokens=6, do_sample=False)[0]["generated_text"]
    assert got == text + tok.decode(list(generate(model, ids, max_new_tokens=6, temperature=0)))


def test_tokens_added_to_gpt2s_are_read_matched_and_written_back(tmp_path):
    """A Hugging Face GPT-2 whose tokenizer added a pad token and whose embeddings were resized
    (50,258 ids): forge-ml ignored the added token. Its text was split into BPE pieces (HF: one
    id), sample failed when the model chose it, serve never chose it, and an export dropped it.
    Now its ids and text are transformers', both ways, through an export and an import."""
    from forge_ml.cli import main
    from forge_ml.inference import load_model
    from forge_ml.models.gpt2 import GPT2, GPT2Config

    cfg = GPT2Config(vocab_size=50257, block_size=32, n_layer=1, n_head=2, n_embd=16)
    save_hf_gpt2(tmp_path / "base", cfg, GPT2.init(cfg, seed=1).state_dict(), tokenizer={"kind": "gpt2"})
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "base")
    hf_tok.add_special_tokens({"pad_token": "<|pad|>"})
    m = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base")
    m.resize_token_embeddings(len(hf_tok), mean_resizing=False)
    m.save_pretrained(tmp_path / "added")
    hf_tok.save_pretrained(tmp_path / "added")
    model, tok, _ = load_model(tmp_path / "added")
    text = "a<|pad|>b <|pad|><|pad|> c"
    assert tok.vocab_size == 50258 == model.config.vocab_size
    assert tok.encode(text) == hf_tok(text).input_ids
    assert tok.decode(tok.encode(text)) == text == hf_tok.decode(hf_tok(text).input_ids)
    assert tok.decode_bytes([64, 50257]) == b"a<|pad|>"
    # through forge-ml's checkpoint and back to a Hugging Face folder: the token is kept
    assert main(["convert", "--from-hf", str(tmp_path / "added"), "--out", str(tmp_path / "ck")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "back")]) == 0
    back = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
    assert len(back) == 50258 and back(text).input_ids == hf_tok(text).input_ids
    assert load_model(tmp_path / "back")[1].encode(text) == tok.encode(text)


def test_a_tokenizer_that_adds_a_prefix_space_is_read_as_such(tmp_path):
    """add_prefix_space=True (a setting of Hugging Face's GPT-2 tokenizer) was not read: the
    folder's text got GPT-2's plain ids ("Hello" 15496 where transformers gives " Hello"
    18435) and greedy text differed. The ids are transformers', with an added token too, and an
    export keeps the setting."""
    from forge_ml.cli import main
    from forge_ml.inference import load_model
    from forge_ml.models.gpt2 import GPT2, GPT2Config

    cfg = GPT2Config(vocab_size=50257, block_size=32, n_layer=1, n_head=2, n_embd=16)
    save_hf_gpt2(tmp_path / "base", cfg, GPT2.init(cfg, seed=1).state_dict(), tokenizer={"kind": "gpt2"})
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "base", add_prefix_space=True)
    hf_tok.add_special_tokens({"pad_token": "<|pad|>"})
    m = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base")
    m.resize_token_embeddings(len(hf_tok), mean_resizing=False)
    m.save_pretrained(tmp_path / "ps")
    hf_tok.save_pretrained(tmp_path / "ps")
    tok = load_model(tmp_path / "ps")[1]
    for text in ("Hello world", " Hello", "a<|pad|>b", "a<|pad|> b", "\nHi", ""):
        assert tok.encode(text) == hf_tok(text).input_ids, text
        assert tok.decode(tok.encode(text)) == hf_tok.decode(hf_tok(text).input_ids)
    assert main(["convert", "--from-hf", str(tmp_path / "ps"), "--out", str(tmp_path / "ck")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "back")]) == 0
    back = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
    assert back("Hello world").input_ids == [18435, 995] == load_model(tmp_path / "back")[1].encode("Hello world")


def _hf_tokenizer_folder(tmp_path, name, edit, **kw):
    """A Hugging Face GPT-2 folder (tiny random model, GPT-2's tokenizer from a forge-ml export)
    whose tokenizer ``edit`` changed, the model resized to it."""
    from forge_ml.models.gpt2 import GPT2, GPT2Config

    base = tmp_path / "base"
    if not base.exists():
        cfg = GPT2Config(vocab_size=50257, block_size=32, n_layer=1, n_head=2, n_embd=16)
        save_hf_gpt2(base, cfg, GPT2.init(cfg, seed=1).state_dict(), tokenizer={"kind": "gpt2"})
    hf_tok = transformers.AutoTokenizer.from_pretrained(base, **kw)
    edit(hf_tok)
    m = transformers.GPT2LMHeadModel.from_pretrained(base)
    m.resize_token_embeddings(len(hf_tok), mean_resizing=False)
    m.save_pretrained(tmp_path / name)
    hf_tok.save_pretrained(tmp_path / name)
    return tmp_path / name, transformers.AutoTokenizer.from_pretrained(tmp_path / name)


def _tokens(*a, **kw):
    return transformers.AddedToken(*a, **kw)


@pytest.mark.parametrize("case", ["low ids", "strip flags", "single word", "special first", "roles"])
def test_added_token_details_match_transformers(tmp_path, case):
    """From a new user's test of the added tokens: tokens with ids below 50257 (add_tokens of a
    GPT-2 word, a pad token "!") were ignored; lstrip/rstrip/single_word were ignored; special
    tokens were not split out before the others; an export lost which tokens are special and
    the pad/additional roles."""
    from forge_ml.cli import main
    from forge_ml.inference import load_model

    edits = {
        "low ids": lambda t: (t.add_tokens(["hello"]), t.add_special_tokens({"pad_token": "!"})),
        "strip flags": lambda t: t.add_special_tokens({"mask_token": _tokens("<mask>", lstrip=True, rstrip=True)}),
        "single word": lambda t: t.add_tokens([_tokens("zqx", single_word=True)]),
        "special first": lambda t: (t.add_tokens(["x<"]), t.add_special_tokens({"pad_token": "<|pad|>"})),
        "roles": lambda t: (t.add_special_tokens({"pad_token": "<|pad|>", "additional_special_tokens": ["<|sep|>"]}),
                            t.add_tokens(["mytok"])),
    }
    folder, hf_tok = _hf_tokenizer_folder(tmp_path, "f", edits[case])
    tok = load_model(folder)[1]
    texts = ["Say hello", "helloworld", "Hi!!", "?!", "a <mask> b", " <mask> ", "a zqx b", "azqx", "zqx",
             "x<|pad|>", "ax<|pad|>b", "Hi<|pad|>mytok<|sep|>x", "plain text, no tokens\n"]
    for text in texts:
        assert tok.encode(text) == hf_tok(text).input_ids, (case, text)
    assert main(["convert", "--from-hf", str(folder), "--out", str(tmp_path / "ck")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "back")]) == 0
    back = transformers.AutoTokenizer.from_pretrained(tmp_path / "back")
    for text in texts:
        if case == "special first" and "x<|" in text:
            continue    # transformers builds the export's tokenizer from vocab.json and merges.txt, and
            # then splits the non-special "x<" first (forge-ml reads the export as the original)
        assert back(text).input_ids == hf_tok(text).input_ids, (case, text)
    assert load_model(tmp_path / "back")[1].encode("ax<|pad|>b") == hf_tok("ax<|pad|>b").input_ids
    assert sorted(back.all_special_ids) == sorted(hf_tok.all_special_ids) and back.pad_token == hf_tok.pad_token


@pytest.mark.parametrize("config, fast, cls, want", [
    (None, True, "GPT2Tokenizer", [15496, 995]), (True, False, "PreTrainedTokenizerFast", [15496, 995]),
    (False, True, "PreTrainedTokenizerFast", [18435, 995]), (True, False, "GPT2Tokenizer", [18435, 995]),
    ("no file", True, None, [15496, 995]), (None, True, "no class", [15496, 995])])
def test_conflicting_prefix_space_settings_are_read_as_transformers_reads_them(tmp_path, config, fast, cls, want):
    """tokenizer_config.json's add_prefix_space rules for GPT-2's tokenizer class, tokenizer.json's
    pre-tokenizer for PreTrainedTokenizerFast (forge-ml took the config's first in every case).
    With no tokenizer_config.json, transformers takes GPT-2's class (from config.json) and its
    default, no prefix space (forge-ml took tokenizer.json's: other ids, a QA report)."""
    from forge_ml.inference import load_model

    folder, _ = _hf_tokenizer_folder(tmp_path, "p", lambda t: t.add_special_tokens({"pad_token": "<|pad|>"}))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("add_prefix_space", None)
    if config is not None:
        cfg["add_prefix_space"] = config
    cfg["tokenizer_class"] = cls
    if cls == "no class":
        del cfg["tokenizer_class"]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    if config == "no file":
        (folder / "tokenizer_config.json").unlink()
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["add_prefix_space"] = fast
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    assert transformers.AutoTokenizer.from_pretrained(folder)("Hello world").input_ids == want
    assert load_model(folder)[1].encode("Hello world") == want


def test_an_export_writes_no_tokenizer_that_is_not_the_models(tmp_path):
    """GPT-2's 50257 ids for a 100-token model: its ids would index past the embedding."""
    cfg = dict(vocab_size=100, block_size=8, n_layer=1, n_head=1, n_embd=4)
    params = {k: np.zeros(s, np.float32) for k, s in gpt2_param_shapes(cfg).items()}
    save_hf_gpt2(tmp_path / "x", cfg, params, tokenizer={"kind": "gpt2"})
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["config.json", "model.safetensors"]


def test_a_folder_whose_tokenizer_is_not_gpt2s_is_read_with_its_tokenizer_json_or_refused(tmp_path):
    """A GPT-2 model trained with another BPE vocabulary of >= 50257 tokens (another
    language's) was read with GPT-2's tokenizer: wrong text, silently. A vocab.json alone now
    says so, and a tokenizer.json is read as the model's own tokenizer (kind "hf"); GPT-2's own
    (with tokens added after 50256) is read as before."""
    import shutil

    from forge_ml.inference.load import hf_tokenizer_dict, load_model
    from forge_ml.tokenizer import gpt2_data_dir

    cfg = dict(vocab_size=50260, block_size=8, n_layer=1, n_head=1, n_embd=4)
    d = tmp_path / "hf"
    save_hf_gpt2(d, cfg, {k: np.zeros(s, np.float32) for k, s in gpt2_param_shapes(cfg).items()})
    gpt2 = json.loads((gpt2_data_dir() / "encoder.json").read_text(encoding="utf-8"))
    (d / "vocab.json").write_text(json.dumps(dict(gpt2, **{"<pad>": 50257})))
    assert hf_tokenizer_dict(d) == {"kind": "gpt2"}
    (d / "vocab.json").unlink()
    merges = [ln for ln in (gpt2_data_dir() / "vocab.bpe").read_text(encoding="utf-8").split("\n")
              if ln.strip() and not ln.startswith("#version")]
    (d / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": gpt2,
                                                            "merges": merges}}))
    assert hf_tokenizer_dict(d) == {"kind": "gpt2"}
    # GPT-2's vocabulary without its merges is not GPT-2's tokenizer (letters, not words)
    (d / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": gpt2,
                                                            "merges": []}}))
    assert hf_tokenizer_dict(d)["kind"] == "hf"
    other = dict(gpt2, **{"Hello": gpt2["world"], "world": gpt2["Hello"]})  # two ids swapped
    (d / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": other, "merges": []}}))
    # its own tokenizer.json is read with the tokenizers library (tests/test_hf_tokenizer.py)
    _, tok, _ = load_model(d)
    assert tok.kind == "hf" and tok.decode([gpt2["Hello"]]) == "world"
    (d / "tokenizer.json").unlink()
    (d / "vocab.json").write_text(json.dumps(other))
    with pytest.raises(CheckpointError, match=r"vocab\.json: this model's tokenizer is not GPT-2's"):
        hf_tokenizer_dict(d)
    # with a merges.txt beside it, the message said there was none: the class is why
    (d / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(CheckpointError, match="names the class 'PreTrainedTokenizerFast'"):
        hf_tokenizer_dict(d)
    shutil.rmtree(d)


@pytest.mark.parametrize("text", ['[1, 2]', '{"kind": "bpe"}', '{"kind": "char", "chars": "aa"}'])
def test_a_broken_forge_ml_tokenizer_file_is_refused_at_import(tmp_path, capsys, text):
    """Not taken into the checkpoint by convert --from-hf, to fail, without the file's name,
    at the first sample."""
    from forge_ml.cli import main
    from forge_ml.hf import HF_TOKENIZER_FILE

    cfg = dict(vocab_size=4, block_size=8, n_layer=1, n_head=1, n_embd=4)
    d = tmp_path / "hf"
    save_hf_gpt2(d, cfg, {k: np.zeros(s, np.float32) for k, s in gpt2_param_shapes(cfg).items()},
                 tokenizer={"kind": "char", "chars": "abc\n"})
    (d / HF_TOKENIZER_FILE).write_text(text)
    assert main(["convert", "--from-hf", str(d), "--out", str(tmp_path / "ck")]) == 2
    assert f"{HF_TOKENIZER_FILE}: not a forge-ml tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()


# -- what an export may replace; unreadable files ------------------------------------------------


def test_an_export_replaces_only_an_earlier_export(saved, tmp_path):
    import shutil

    from forge_ml.hf import HF_TOKENIZER_FILE, is_hf_export
    config, params = load_hf_gpt2(saved[0])
    out = tmp_path / "export"
    save_hf_gpt2(out, config, params, tokenizer={"kind": "char", "chars": "ab"})
    assert json.loads((out / HF_TOKENIZER_FILE).read_text()) == {"kind": "char", "chars": "ab"}
    assert is_hf_export(out)
    save_hf_gpt2(out, config, params)                    # an earlier export: replaced whole
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    transformers.GPT2LMHeadModel.from_pretrained(out)    # the mark does not bother transformers
    # a model transformers saved, even reduced to the same two files, is the user's: never replaced
    theirs = tmp_path / "theirs"
    shutil.copytree(saved[0], theirs)
    for f in theirs.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            f.unlink()
    before = {f.name: f.read_bytes() for f in theirs.iterdir()}
    assert not is_hf_export(theirs)
    with pytest.raises(CheckpointError, match="not a Hugging Face export that forge-ml wrote"):
        save_hf_gpt2(theirs, config, params)
    assert {f.name: f.read_bytes() for f in theirs.iterdir()} == before
    (out / "notes.txt").write_text("mine")               # an export with a user's file in it
    with pytest.raises(CheckpointError, match=r"notes\.txt"):
        save_hf_gpt2(out, config, params)
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_an_unreadable_file_says_permission_denied(saved, monkeypatch, name):
    """safetensors reports a file it may not open as 'No such file or directory'."""
    denied_open(monkeypatch, name)
    with pytest.raises(CheckpointError, match=rf"{name}: cannot read it: Permission denied"):
        load_hf_gpt2(saved[0])


def test_a_gpt2_folder_s_own_eos_ids_end_generation_and_are_exported(tmp_path):
    """A GPT-2-vocabulary folder whose generation config ends on more ids than 50256 ("." too)
    ran on past them: GPT-2's tokenizer stopped on 50256 alone, and an export wrote 50256 back
    (a QA report; a folder's own tokenizer honoured its eos ids already)."""
    from forge_ml.cli import main
    from forge_ml.inference import load_model

    cfg = dict(vocab_size=50257, block_size=8, n_layer=1, n_head=1, n_embd=4)
    params = {k: np.zeros(s, np.float32) for k, s in gpt2_param_shapes(cfg).items()}
    gen, plain = tmp_path / "gen", tmp_path / "plain"
    for d in (gen, plain):
        save_hf_gpt2(d, cfg, params, tokenizer={"kind": "gpt2"})
    (gen / "generation_config.json").write_text(json.dumps({"eos_token_id": [50256, 13]}))
    conf = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps(dict(conf, eos_token_id=13)))
    assert load_model(gen)[1].stop_tokens == (50256, 13)
    assert load_model(plain)[1].stop_tokens == (13,)
    assert load_model(tmp_path / "gen")[2]["tokenizer"]["eos_token_id"] == [50256, 13]
    assert main(["convert", "--from-hf", str(gen), "--out", str(tmp_path / "ck")]) == 0
    assert main(["convert", "--to-hf", str(tmp_path / "ck"), "--out", str(tmp_path / "back")]) == 0
    assert json.loads((tmp_path / "back" / "config.json").read_text())["eos_token_id"] == [50256, 13]
    assert load_model(tmp_path / "back")[1].stop_tokens == (50256, 13)
    # GPT-2's own (50256 alone, as an int or a list) keeps the plain tokenizer dict
    (gen / "generation_config.json").write_text(json.dumps({"eos_token_id": [50256]}))
    assert load_model(gen)[2]["tokenizer"] == {"kind": "gpt2"}


@pytest.mark.parametrize("eos, stop_id, shown", [([50256, 13], 13, "."), ([50256, 13], 50256, "")])
def test_a_stop_token_that_is_not_special_is_part_of_the_text(tmp_path, capsys, eos, stop_id, shown):
    """With a "." (13) among the eos ids, transformers' pipeline and vLLM keep the "." that
    ends the text (only special tokens are left out); forge-ml sample left every stop token
    out: "Hi" where they give "Hi.". <|endoftext|> stays out."""
    from forge_ml.cli import main

    cfg = dict(vocab_size=50257, block_size=16, n_layer=1, n_head=1, n_embd=4, tied_head=False)
    params = {k: np.zeros(s, np.float32) for k, s in gpt2_param_shapes(cfg).items()}
    params["ln_f.bias"][:] = 1.0                       # every position's output: ones
    params["lm_head.weight"][stop_id] = 1.0            # greedy: stop_id at every step
    save_hf_gpt2(tmp_path / "m", cfg, params, tokenizer={"kind": "gpt2", "eos_token_id": eos})
    for argv in ([], ["--num-beams", "2"], ["--logprobs", "1"]):
        assert main(["sample", "--ckpt", str(tmp_path / "m"), "--prompt", "Hi", "--temperature", "0",
                     "--max-new-tokens", "4", *argv]) == 0
        out = capsys.readouterr().out
        assert out.splitlines()[0] == "Hi" + shown, (argv, out)


def test_a_folder_with_its_own_eos_ids_fine_tunes_and_evaluates_gpt2_data(tmp_path, monkeypatch):
    """The eos ids are no part of which ids a text gets: a GPT-2 data folder (prepared without
    them) is the tokenizer of a folder that names [50256, 13] (it was refused, "another
    tokenizer ... (gpt2, 50257 ids) than hf's (gpt2, 50257 ids)": a review's find). A
    generation_config.json that cannot be read falls back to config.json, as transformers."""
    from forge_ml.cli import main
    from forge_ml.inference import load_model

    monkeypatch.chdir(tmp_path)
    cfg = dict(vocab_size=50257, block_size=16, n_layer=1, n_head=1, n_embd=4)
    save_hf_gpt2("hf", cfg, {k: np.zeros(s, np.float32) for k, s in gpt2_param_shapes(cfg).items()})
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": [50256, 13]}))
    (tmp_path / "t.txt").write_text("Hello world. " * 400)
    assert main(["prepare", "t.txt", "--out", "data", "--tokenizer", "gpt2"]) == 0
    assert main(["eval", "--ckpt", "hf", "--data", "data"]) == 0
    assert main(["train", "--data", "data", "--init-from", "hf", "--out", "ft", "--max-steps", "2",
                 "--batch-size", "2", "--eval-iters", "1", "--eval-interval", "0", "--sample-interval", "0",
                 "--no-progress", "--final-eval-windows", "2"]) == 0
    assert main(["train", "--out", "ft", "--resume", "--max-steps", "3", "--no-progress"]) == 0
    (tmp_path / "hf" / "generation_config.json").write_text("{not json")
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(conf, eos_token_id=13)))
    assert load_model("hf")[1].stop_tokens == (13,)


def test_a_config_of_far_more_layers_than_the_weights_is_refused_at_once(tmp_path):
    """A QA report: n_layer 10**6 in config.json took 37 s and 3.4 GB (10**8: minutes) to list
    the missing tensors of a table of every layer's; the layers the weights hold are counted
    first."""
    import time
    cfg = dict(vocab_size=8, block_size=8, n_layer=1, n_head=1, n_embd=4)
    d = tmp_path / "hf"
    save_hf_gpt2(d, cfg, {k: np.zeros(s, np.float32) for k, s in gpt2_param_shapes(cfg).items()})
    spec = json.loads((d / "config.json").read_text())
    spec["n_layer"] = 10 ** 8
    (d / "config.json").write_text(json.dumps(spec))
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match="it says n_layer 100,000,000, the weights hold 1 layer"):
        load_hf_gpt2(d)
    assert time.perf_counter() - t0 < 30     # (minutes before)


@pytest.mark.parametrize("eos", ["x", -1, True, 50256.0, [7, "a"]])
def test_an_eos_token_id_that_is_no_id_is_said_not_dropped_in_silence(tmp_path, eos):
    """A QA report: config.json's eos_token_id "x", -1, true or 50256.0 converted and sampled
    without a word, and generation then never stopped on it."""
    from forge_ml.inference.load import hf_tokenizer_dict
    cfg = dict(vocab_size=50257, block_size=8, n_layer=1, n_head=1, n_embd=4)
    d = tmp_path / "hf"
    save_hf_gpt2(d, cfg, {k: np.zeros(s, np.float32) for k, s in gpt2_param_shapes(cfg).items()})
    spec = json.loads((d / "config.json").read_text())
    spec["eos_token_id"] = eos
    (d / "config.json").write_text(json.dumps(spec))
    with pytest.warns(UserWarning, match="eos_token_id .* which is no token id"):
        got = hf_tokenizer_dict(d)
    assert got.get("eos_token_id") in (None, 7)


def test_the_hf_functions_refuse_what_is_no_path_or_config_by_name():
    """A QA report: None or an int as the folder was Python's TypeError from inside (load and
    save, the dropout reader, is_hf_export), and a config without vocab_size a KeyError."""
    from forge_ml.hf import is_hf_export, load_hf_dropout
    for call in (lambda: load_hf_gpt2(None), lambda: save_hf_gpt2(5, {}, {}),
                 lambda: load_hf_dropout(None), lambda: is_hf_export(None)):
        with pytest.raises(CheckpointError, match="must be a path"):
            call()
    with pytest.raises(CheckpointError, match="the config lacks vocab_size"):
        gpt2_param_shapes({"n_embd": 4})
