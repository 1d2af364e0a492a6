"""A Hugging Face GPT-2 folder with its own byte-level BPE (tokenizer.json, not GPT-2's
vocabulary): read with that tokenizer (kind "hf", the tokenizers library), the same ids and
text as transformers, through import, sampling, export and training. It was refused ("this
model's tokenizer is not GPT-2's")."""
import builtins
import json
import logging
import shutil

import numpy as np
import pytest

from forge_ml.cli import main
from forge_ml.errors import CheckpointError, TokenizerError

tokenizers = pytest.importorskip("tokenizers")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

CORPUS = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
          "Ünïcödé wörds, 日本語のテキスト, emoji 🦜🦜 and café crème; def f(x):\n    return x + 1\n") * 20

TEXTS = ["", "Hello world", "  two leading spaces", "trailing  ", "a   b\n\n c\n\n\n", "\t\ttabs\r\n",
         "héllo wörld 日本語 🦜🦜🙂", "x<|endoftext|>y", "<|endoftext|>", " , . I 'm n't they 're",
         "ﬁne ① ＡＢＣ", "def f(x):\n    return x + 1\n"]


def _byte_level_bpe(text: str, size: int):
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder) of ``size`` tokens trained on
    ``text`` by the tokenizers library, <|endoftext|> its special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def _hf_folder(path, seed=0):
    """A byte-level BPE of 300 tokens trained on CORPUS and a small random GPT-2 with it,
    saved by transformers (as the task's reproduction writes it)."""
    tok = _byte_level_bpe(CORPUS, 300)
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=64, n_layer=1, n_head=2, n_embd=16,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():   # logits far apart: greedy choices that float rounding cannot flip
        for p in model.parameters():
            p.normal_(0, 0.5)
    model.save_pretrained(path)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hfdir(tmp_path_factory):
    return _hf_folder(tmp_path_factory.mktemp("hf") / "hfsmall")


_EOT = {"content": "<|endoftext|>", "lstrip": False, "normalized": True, "rstrip": False, "single_word": False,
        "special": True}
CONFIGS = {
    "as saved": None,
    # what transformers 4 wrote for a GPT2TokenizerFast (the class most Hub GPT-2 folders name)
    "GPT2Tokenizer": {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": {"0": _EOT},
                      "bos_token": "<|endoftext|>", "clean_up_tokenization_spaces": True,
                      "eos_token": "<|endoftext|>", "errors": "replace", "model_max_length": 1024,
                      "pad_token": None, "tokenizer_class": "GPT2Tokenizer", "unk_token": "<|endoftext|>"},
    "GPT2 prefix space": {"tokenizer_class": "GPT2TokenizerFast", "add_prefix_space": True},
    # a pad token that is not in the tokenizer: transformers adds it (id 300)
    "new pad token": {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                      "pad_token": "<pad>", "clean_up_tokenization_spaces": True},
    "no tokenizer_config": "delete",
}


def _variant(hfdir, tmp_path, name):
    d = tmp_path / "v"
    shutil.copytree(hfdir, d)
    cfg = CONFIGS[name]
    if cfg == "delete":
        (d / "tokenizer_config.json").unlink()
    elif cfg is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("name", list(CONFIGS))
def test_encode_and_decode_match_transformers(hfdir, tmp_path, name):
    from forge_ml.inference.load import hf_tokenizer_dict
    from forge_ml.tokenizer import tokenizer_from_dict

    d = _variant(hfdir, tmp_path, name)
    spec = hf_tokenizer_dict(d)
    assert spec["kind"] == "hf"
    tok = tokenizer_from_dict(json.loads(json.dumps(spec)))   # as a checkpoint's meta holds it
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    assert tok.vocab_size == len(theirs)
    for text in TEXTS + [CORPUS]:
        ids = theirs(text)["input_ids"]
        assert tok.encode(text) == ids, text
        assert tok.encode_array(text).tolist() == ids
        assert tok.decode(ids) == theirs.decode(ids), text
        assert tok.decode_bytes(ids).decode("utf-8", "replace") == theirs.decode(ids)
    # the special token matched in the text
    assert 0 in theirs("a<|endoftext|>b")["input_ids"] and tok.encode("a<|endoftext|>b") == \
        theirs("a<|endoftext|>b")["input_ids"]
    assert tok.eot_token == 0 and tok.to_dict() == spec


def _gpt2_tokenizer_json() -> dict:
    """GPT-2's tokenizer.json as transformers writes it (vocabulary and merges forge-ml's)."""
    from forge_ml.tokenizer import gpt2_data_dir
    gpt2 = json.loads((gpt2_data_dir() / "encoder.json").read_text(encoding="utf-8"))
    merges = [ln.split(" ") for ln in (gpt2_data_dir() / "vocab.bpe").read_text(encoding="utf-8").split("\n")
              if ln.strip() and not ln.startswith("#version")]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": 50256, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": True, "special": True}],
            "normalizer": None, "pre_tokenizer": byte_level,
            "post_processor": {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}}],
                               "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                        {"Sequence": {"id": "B", "type_id": 1}}], "special_tokens": {}},
            "decoder": dict(byte_level, add_prefix_space=True),
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                      "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": gpt2, "merges": merges}}


BOS_TEMPLATE = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [50256],
                                                     "tokens": ["<|endoftext|>"]}}}


@pytest.mark.parametrize("cls", ["PreTrainedTokenizerFast", "GPT2Tokenizer"])
@pytest.mark.parametrize("change,kind", [
    ({}, {"PreTrainedTokenizerFast": "gpt2", "GPT2Tokenizer": "gpt2"}),
    ({"normalizer": {"type": "Lowercase"}}, {"PreTrainedTokenizerFast": "hf", "GPT2Tokenizer": "gpt2"}),
    ({"normalizer": {"type": "NFKC"}}, {"PreTrainedTokenizerFast": "hf", "GPT2Tokenizer": "gpt2"}),
    ({"post_processor": BOS_TEMPLATE}, {"PreTrainedTokenizerFast": "hf", "GPT2Tokenizer": "hf"}),
])
def test_a_gpt2_vocabulary_tokenizer_json_is_read_as_transformers_reads_it(tmp_path, change, kind, cls):
    """A tokenizer.json of GPT-2's vocabulary was read as GPT-2's whatever else it held: a
    lowercasing or NFKC normalizer, a post-processor putting <|endoftext|> before every text
    (a QA report: other ids than transformers', in silence). Now the folder's own tokenizer
    ("hf") where transformers runs the file as written (a generic class), and GPT-2's where it
    builds GPT-2's pipeline and keeps only the vocabulary, merges and post-processor (GPT-2's
    class): the same ids as AutoTokenizer either way."""
    from forge_ml.inference.load import hf_tokenizer_dict
    from forge_ml.tokenizer import tokenizer_from_dict

    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps(dict(_gpt2_tokenizer_json(), **change)))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": cls, "add_prefix_space": False,
                                                         "eos_token": "<|endoftext|>"}))
    spec = hf_tokenizer_dict(d)
    assert spec["kind"] == kind[cls]
    ours, theirs = tokenizer_from_dict(spec), transformers.AutoTokenizer.from_pretrained(d)
    for text in ["Hello World", "ﬁne ① ＡＢＣ café", "  two  spaces\n", ""]:
        assert ours.encode(text) == theirs(text)["input_ids"], text


def test_streamed_text_is_decodes_text_with_its_clean_up_of_spaces():
    """A tokenizer with transformers' clean_up_tokenization_spaces (" ," -> ",", " 'm" -> "'m")
    streamed its raw text (TextStream: forge-ml sample, serve): "i ' m ok , ok" where decode
    and transformers give "i'm ok, ok" (a QA report). The stream now holds back what the
    clean-up may still change: its pieces add up to decode's text, token by token, over random
    sequences of the words and marks the clean-up joins."""
    from forge_ml.tokenizer import HFTokenizer, TextStream, hf_tokenizer_spec

    words = ["i", "'", "m", "ok", ",", ".", "?", "!", "n't", "s", "ve", "re", "'s", "y", "x", "n", "t"]
    vocab = {w: i for i, w in enumerate(words + ["[UNK]"])}
    spec = {"model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
            "pre_tokenizer": {"type": "BertPreTokenizer"},
            "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False}}
    tok = HFTokenizer(hf_tokenizer_spec(spec, {"tokenizer_class": "PreTrainedTokenizerFast",
                                               "clean_up_tokenization_spaces": True}))
    ids = tok.encode("i'm ok , ok")
    stream = TextStream(tok)
    assert "".join(stream.feed(i) for i in ids) + stream.flush() == tok.decode(ids) == "i'm ok, ok"
    rng = np.random.default_rng(0)
    for _ in range(1000):
        ids = rng.integers(0, len(words), rng.integers(1, 16)).tolist()
        stream = TextStream(tok)
        pieces = [stream.feed(i) for i in ids] + [stream.flush()]
        assert "".join(pieces) == tok.decode(ids), [words[i] for i in ids]


@pytest.mark.parametrize("merges", ["all", "half"])
def test_gpt2s_vocab_json_with_other_merges_is_read_with_them(tmp_path, merges):
    """GPT-2's vocab.json beside a merges.txt that is not GPT-2's (its first 20,000 merges)
    was read as GPT-2's tokenizer, with forge-ml's own merges (a QA report: other ids than
    transformers', in silence); a merges.txt of garbage was taken too, where transformers
    refuses it. The folder's merges now decide, as in transformers."""
    from forge_ml.inference.load import hf_tokenizer_dict
    from forge_ml.tokenizer import gpt2_data_dir, tokenizer_from_dict

    lines = (gpt2_data_dir() / "vocab.bpe").read_text(encoding="utf-8").split("\n")
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(gpt2_data_dir() / "encoder.json", d / "vocab.json")
    (d / "merges.txt").write_text("\n".join(lines) if merges == "all" else "\n".join(lines[:20001]) + "\n")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    spec = hf_tokenizer_dict(d)
    assert spec["kind"] == ("gpt2" if merges == "all" else "hf")
    text = "ROMEO: Hello there, General Kenobi!"
    assert tokenizer_from_dict(spec).encode(text) == \
        transformers.AutoTokenizer.from_pretrained(d)(text)["input_ids"]
    (d / "merges.txt").write_text("garbage\n")
    with pytest.raises(CheckpointError, match="merges.txt"):
        hf_tokenizer_dict(d)


def test_an_added_tokens_decoder_that_is_no_object_is_refused_by_name(tmp_path):
    """"added_tokens_decoder": [1, 2] was an AttributeError traceback from sample and convert."""
    from forge_ml.inference.load import hf_tokenizer_dict
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": [1, 2]}))
    with pytest.raises(CheckpointError, match="added_tokens_decoder is a JSON list"):
        hf_tokenizer_dict(d)


def test_long_text_is_encoded_in_parallel_pieces_with_the_same_ids(hfdir):
    from forge_ml.data import encode_array
    from forge_ml.inference.load import hf_tokenizer_dict
    from forge_ml.tokenizer import tokenizer_from_dict

    tok = tokenizer_from_dict(hf_tokenizer_dict(hfdir))
    text = CORPUS * 5 + "x<|endoftext|>y\n" + CORPUS
    whole = tok.encode(text)
    assert tok._chunkable()
    assert tok.encode_array(text, chunk=500).tolist() == whole     # dozens of pieces
    assert encode_array(tok, text).dtype == np.uint32
    # a negative chunk looped for ever, its pieces growing (a QA report)
    for bad in (-5, 0, None):
        with pytest.raises(TokenizerError, match="chunk must be an int of at least 1"):
            tok.encode_array(text, chunk=bad)


def test_a_folder_of_vocab_json_and_merges_txt_matches_transformers(hfdir, tmp_path):
    """No tokenizer.json: the byte-level BPE that transformers' GPT2Tokenizer builds of them."""
    from forge_ml.inference.load import hf_tokenizer_dict
    from forge_ml.tokenizer import tokenizer_from_dict

    spec = json.loads((hfdir / "tokenizer.json").read_text(encoding="utf-8"))
    d = tmp_path / "vm"
    shutil.copytree(hfdir, d)
    (d / "tokenizer.json").unlink()
    (d / "tokenizer_config.json").unlink()
    (d / "vocab.json").write_text(json.dumps(spec["model"]["vocab"]), encoding="utf-8")
    (d / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in spec["model"]["merges"]) + "\n",
                                  encoding="utf-8")
    tok = tokenizer_from_dict(hf_tokenizer_dict(d))
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    for text in TEXTS:
        ids = theirs(text)["input_ids"]
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == theirs.decode(ids)
    (d / "merges.txt").unlink()          # vocab.json alone: refused, saying what is missing
    with pytest.raises(CheckpointError, match="not GPT-2's.*no tokenizer.json.*merges.txt"):
        hf_tokenizer_dict(d)


def test_convert_then_sample_gives_transformers_greedy_tokens(hfdir, tmp_path, capsys):
    from forge_ml.inference import load_model, stream_tokens

    out = tmp_path / "f"
    assert main(["convert", "--from-hf", str(hfdir), "--out", str(out)]) == 0
    theirs_tok = transformers.AutoTokenizer.from_pretrained(hfdir)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(hfdir).eval()
    prompt = "Speak, speak"
    ids = theirs_tok(prompt)["input_ids"]
    with torch.no_grad():
        want = theirs.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                               pad_token_id=0)[0, len(ids):].tolist()
    for src in (out, hfdir):     # the converted checkpoint, and the folder itself
        model, tok, _ = load_model(src)
        assert tok.kind == "hf" and tok.encode(prompt) == ids
        got = []
        for t in stream_tokens(model, ids, 12, temperature=0, stop_tokens=tok.stop_tokens):
            got.append(t)
            if t in tok.stop_tokens:
                break
        assert got == want
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(out), "--prompt", prompt, "--max-new-tokens", "12",
                 "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    assert text == prompt + theirs_tok.decode([t for t in want if t != 0]) + "\n"
    assert len(want) >= 3


def test_export_round_trip_loads_in_transformers_with_the_same_ids_and_logits(hfdir, tmp_path):
    from forge_ml.inference.load import hf_tokenizer_dict

    f, back = tmp_path / "f", tmp_path / "back"
    assert main(["convert", "--from-hf", str(hfdir), "--out", str(f)]) == 0
    assert main(["convert", "--to-hf", str(f), "--out", str(back)]) == 0
    cfg = json.loads((back / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["eos_token"] == "<|endoftext|>"
    assert json.loads((back / "config.json").read_text())["eos_token_id"] == 0
    a = transformers.AutoTokenizer.from_pretrained(hfdir)
    b = transformers.AutoTokenizer.from_pretrained(back)
    for text in TEXTS + [CORPUS]:
        assert a(text)["input_ids"] == b(text)["input_ids"], text
        assert a.decode(a(text)["input_ids"]) == b.decode(b(text)["input_ids"])
    x = torch.tensor([a(CORPUS[:200])["input_ids"][:64]])
    with torch.no_grad():
        la = transformers.GPT2LMHeadModel.from_pretrained(hfdir).eval()(x).logits
        lb = transformers.GPT2LMHeadModel.from_pretrained(back).eval()(x).logits
    assert torch.equal(la, lb)
    (back / "forge_ml_tokenizer.json").unlink()    # read back through its tokenizer.json alone
    assert hf_tokenizer_dict(back) == hf_tokenizer_dict(hfdir)


def test_training_from_the_folder_keeps_its_tokenizer(hfdir, tmp_path, capsys):
    from forge_ml.checkpoint import read_meta
    from forge_ml.data import read_shard
    from forge_ml.tokenizer import tokenizer_from_dict

    src = tmp_path / "src"
    shutil.copytree(hfdir, src)
    want = transformers.AutoTokenizer.from_pretrained(src)
    (tmp_path / "t.txt").write_text(CORPUS, encoding="utf-8")
    run = tmp_path / "run"
    assert main(["train", "--init-from", str(src), "--data", str(tmp_path / "t.txt"), "--out", str(run),
                 "--max-steps", "3", "--batch-size", "2", "--block-size", "32", "--eval-interval", "0",
                 "--sample-interval", "0", "--log-interval", "0", "--final-eval-windows", "2"]) == 0
    assert "hf tokenizer" in capsys.readouterr().out
    shutil.rmtree(src)               # the checkpoint and the shards need nothing of the folder
    ids = want(CORPUS)["input_ids"]
    shards = np.concatenate([read_shard(run / "data" / "train.bin"), read_shard(run / "data" / "val.bin")])
    assert shards.tolist() == ids
    for d in (read_meta(run / "ckpt")["tokenizer"],
              json.loads((run / "data" / "tokenizer.json").read_text(encoding="utf-8"))):
        tok = tokenizer_from_dict(d)
        assert tok.kind == "hf" and tok.encode(CORPUS) == ids and tok.decode(ids) == want.decode(ids)
    assert main(["sample", "--ckpt", str(run), "--prompt", "", "--max-new-tokens", "4"]) == 0


def test_without_the_tokenizers_package_one_line_says_to_install_it(hfdir, tmp_path, monkeypatch, capsys):
    from forge_ml.inference.load import hf_tokenizer_dict
    from forge_ml.tokenizer import tokenizer_from_dict

    spec = hf_tokenizer_dict(hfdir)
    real = builtins.__import__

    def no_tokenizers(name, *args, **kwargs):
        if name == "tokenizers" or name.startswith("tokenizers."):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tokenizers)
    with pytest.raises(TokenizerError, match=r"needs the package tokenizers.*pip install tokenizers"):
        tokenizer_from_dict(spec)
    assert main(["sample", "--ckpt", str(hfdir), "--prompt", "Hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install tokenizers" in err, err


def _bpe_with_newline_merges():
    """A byte-level BPE (GPT-2's regex) trained on text with "\\n\\n    " and " \\n" before
    letters, so that it has the merges ĊĊ and ĠĊ of GPT-2-style vocabularies."""
    corpus = ("def f(x):\n\n    return x\n \nsome text \n\nmore text \n\n    end 's café\n\tx\n") * 50
    tok = _byte_level_bpe(corpus, 320)
    vocab = tok.get_vocab()
    assert "ĊĊ" in vocab and "ĠĊ" in vocab
    return tok


def test_parallel_pieces_are_cut_only_where_the_whole_text_is_cut(tmp_path):
    """A piece ending in "\\n\\n" or " \\n" is pre-tokenized apart from what follows, where the
    whole text's regex (``\\s+(?!\\S)|\\s+``) splits "\\n\\n    x" as "\\n\\n   " + " x": the pieces
    are cut only after a non-space character."""
    import random

    from forge_ml.inference.load import hf_tokenizer_dict
    from forge_ml.tokenizer import tokenizer_from_dict

    tok = _bpe_with_newline_merges()
    d = tmp_path / "nl"
    d.mkdir()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(d)
    ours = tokenizer_from_dict(hf_tokenizer_dict(d))
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    assert ours._chunkable()
    text = "def f(x):\n\n    return x\n \nsome text \nmore\n\n\nend\n" * 40
    pieces = ours._pieces(text, 10)
    assert len(pieces) > 20 and "".join(pieces) == text
    assert ours.encode_array(text, chunk=10).tolist() == ours.encode(text) == theirs(text)["input_ids"]
    rng = random.Random(0)
    parts = ["\n\n", " \n", "\t", "'s", "é", "<|endoftext|>", "a", "b c", "\n", " ", "x\n", "  ", "\n\n\n  y"]
    for _ in range(300):
        t = "".join(rng.choice(parts) for _ in range(rng.randrange(1, 40)))
        assert ours.encode_array(t, chunk=rng.choice([1, 2, 5, 10])).tolist() == ours.encode(t) == \
            theirs(t)["input_ids"], repr(t)


def _wordlevel_json():
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2, "<|endoftext|>": 3}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return json.loads(tok.to_str())


@pytest.mark.parametrize("cls, model", [
    ("LlamaTokenizerFast", None), ("LlamaTokenizer", None), ("T5TokenizerFast", None), ("BertTokenizer", None),
    (None, "WordLevel"), ("GPT2TokenizerFast", "WordLevel")])
def test_a_tokenizer_class_that_transformers_rebuilds_otherwise_is_refused(hfdir, tmp_path, cls, model):
    """transformers 5 rebuilds the pipeline of a named class (Llama's, T5's) from the file's
    vocabulary, and GPT-2's (the class of a folder that names none) as a byte-level BPE: other
    ids than the file run as is (2 of 12 texts for Llama, 5 of 12 for T5). Refused, in one line,
    naming the class; PreTrainedTokenizerFast and TokenizersBackend run the file as is."""
    from forge_ml.inference.load import hf_tokenizer_dict, load_model

    d = tmp_path / "c"
    shutil.copytree(hfdir, d)
    if model == "WordLevel":
        (d / "tokenizer.json").write_text(json.dumps(_wordlevel_json()))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": cls} if cls else {}))
    with pytest.raises(CheckpointError) as e:
        hf_tokenizer_dict(d)
    msg = str(e.value)
    assert "\n" not in msg and (cls or "no tokenizer class") in msg, msg
    assert "PreTrainedTokenizerFast" in msg and "GPT-2's" in msg, msg
    with pytest.raises(CheckpointError):
        load_model(d)


@pytest.mark.parametrize("cls", ["PreTrainedTokenizerFast", "TokenizersBackend"])
def test_a_generic_tokenizer_class_runs_the_file_as_is(hfdir, tmp_path, cls):
    from forge_ml.inference.load import hf_tokenizer_dict
    from forge_ml.tokenizer import tokenizer_from_dict

    d = tmp_path / "g"
    shutil.copytree(hfdir, d)
    (d / "tokenizer.json").write_text(json.dumps(_wordlevel_json()))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": cls, "eos_token": "<|endoftext|>"}))
    tok = tokenizer_from_dict(hf_tokenizer_dict(d))
    theirs = transformers.AutoTokenizer.from_pretrained(d)
    for text in ("a b", "a c b", "b<|endoftext|>a", ""):
        assert tok.encode(text) == theirs(text)["input_ids"], text
        assert tok.decode(tok.encode(text)) == theirs.decode(theirs(text)["input_ids"])


def test_sample_streams_a_metaspace_tokenizer_with_its_spaces(tmp_path, capsys):
    """forge-ml sample of a model whose tokenizer is not byte-level (Metaspace, as Llama-style
    ones): the text printed is the prompt and what decode gives after it (the tokens decoded
    one by one lost their spaces: "▁is" alone is "is"); it stops on any of its eos ids."""
    from test_generate import make_model
    from test_serve import metaspace_tokenizer

    from forge_ml.checkpoint import save_checkpoint
    from forge_ml.inference import stream_tokens
    from forge_ml.models.gpt2 import GPT2Config

    tok = metaspace_tokenizer()
    cfg = GPT2Config(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=16)
    model = make_model(cfg, seed=0)
    save_checkpoint(tmp_path / "ck", model.state_dict(), {"config": cfg.to_dict(), "tokenizer": tok.to_dict()})
    assert tok.stop_tokens == (1, 2)
    for prompt in ("Hello world", ""):
        ids = tok.encode(prompt) if prompt else tok.empty_prompt()
        gen = []
        for t in stream_tokens(model, ids, 30, temperature=0, stop_tokens=tok.stop_tokens):
            if t in tok.stop_tokens:
                break
            gen.append(t)
        want = tok.decode(ids + gen)[len(tok.decode(ids)):]
        assert main(["sample", "--ckpt", str(tmp_path / "ck"), "--prompt", prompt, "--max-new-tokens", "30",
                     "--temperature", "0"]) == 0
        out = capsys.readouterr().out
        assert out == prompt + want + "\n"
        assert len(gen) >= 5 and " " in want.strip()


def test_an_added_token_id_that_is_not_a_decimal_number_is_skipped(hfdir, tmp_path):
    """"²".isdigit() is true and int("²") raises: an added_tokens_decoder key like it stopped
    the folder's reading with a ValueError traceback; it is skipped, as any other non-number."""
    from forge_ml.inference.load import _hf_added_tokens, hf_tokenizer_dict

    d = tmp_path / "sq"
    shutil.copytree(hfdir, d)
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
           "added_tokens_decoder": {"²": dict(_EOT, content="<x>"), "0": _EOT}}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert hf_tokenizer_dict(d)["kind"] == "hf"
    assert _hf_added_tokens(d)[0] == {}


def test_the_tokenizer_fit_message_names_the_tokenizer_it_read(hfdir):
    """A model with fewer ids than its own "hf" tokenizer: the message did not say that a
    folder without a tokenizer is read with GPT-2's, which is not this case."""
    from forge_ml.errors import ConfigError
    from forge_ml.inference.load import check_tokenizer_fits, hf_tokenizer_dict
    from forge_ml.models.gpt2 import GPT2, GPT2Config
    from forge_ml.tokenizer import tokenizer_from_dict

    model = GPT2.init(GPT2Config(vocab_size=8, block_size=8, n_layer=1, n_head=1, n_embd=8))
    with pytest.raises(ConfigError) as e:
        check_tokenizer_fits(model, tokenizer_from_dict(hf_tokenizer_dict(hfdir)), "m")
    assert "GPT-2's" not in str(e.value) and "(hf)" in str(e.value)
    with pytest.raises(ConfigError, match="without a tokenizer of its own is read with GPT-2's"):
        check_tokenizer_fits(model, tokenizer_from_dict({"kind": "gpt2"}), "m")


def test_a_char_models_export_without_forge_mls_record_keeps_its_ids(tmp_path, capsys):
    """A char model converted to a Hugging Face folder that then lost forge_ml_tokenizer.json
    (re-saved by transformers, or taken from the Hub) reads its tokenizer.json: the same ids,
    so eval takes the char run's own shards (refused as "made with another tokenizer"), and a
    character outside the alphabet is named as the char tokenizer names it (it was the
    tokenizers library's "Missing [UNK] token")."""
    from forge_ml.inference import load_model
    from forge_ml.tokenizer import same_ids
    (tmp_path / "t.txt").write_text(CORPUS, encoding="utf-8")
    run, hf = tmp_path / "run", tmp_path / "hf"
    assert main(["train", "--data", str(tmp_path / "t.txt"), "--tokenizer", "char", "--out", str(run),
                 "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
                 "--max-steps", "2", "--batch-size", "2", "--eval-interval", "0", "--sample-interval", "0",
                 "--log-interval", "0", "--final-eval-windows", "2"]) == 0
    assert main(["convert", "--to-hf", str(run), "--out", str(hf)]) == 0
    (hf / "forge_ml_tokenizer.json").unlink()
    _, tok, meta = load_model(str(hf))
    _, ctok, cmeta = load_model(str(run))
    assert tok.kind == "hf" and ctok.kind == "char"
    assert same_ids(meta["tokenizer"], cmeta["tokenizer"])
    assert tok.encode(CORPUS) == ctok.encode(CORPUS)
    other = dict(cmeta["tokenizer"], chars=cmeta["tokenizer"]["chars"][::-1])
    assert not same_ids(meta["tokenizer"], other)       # another alphabet's order: other ids
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(hf), "--data", str(run / "data")]) == 0
    assert "loss" in capsys.readouterr().out
    with pytest.raises(TokenizerError, match="character 'Q' at position 1 is not in the vocabulary"):
        tok.encode("aQ")                                 # (no Q in the corpus)


def test_a_lone_surrogate_is_named_where_it_is():
    """It said "the tokenizers library cannot encode the text (TextInputSequence must be str)"."""
    from forge_ml.tokenizer import HFTokenizer, hf_tokenizer_spec
    spec = {"model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "[UNK]": 2}, "unk_token": "[UNK]"},
            "pre_tokenizer": {"type": "Whitespace"}}
    tok = HFTokenizer(hf_tokenizer_spec(spec, {"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(TokenizerError, match=r"lone surrogate \('\\ud800'\) at character 1"):
        tok.encode("a\ud800b")
