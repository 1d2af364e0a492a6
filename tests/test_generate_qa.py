"""QA of the generation path as a transformers user meets it: the text after the prompt
(``generate_text``, stop strings, ``forge-ml sample --num-beams``) for a tokenizer whose tokens'
text depends on what precedes them (Metaspace), empty prompts, and the edges of the
arguments."""
import json

import pytest

from forge_ml.cli import main
from forge_ml.inference.beam import beam_search
from forge_ml.inference.generate import generate, generate_text
from forge_ml.models.gpt2 import GPT2Config
from forge_ml.tokenizer import CharTokenizer
from test_generate import make_model

PROMPT = "Hello world"


def metaspace_tokenizer():
    """An "hf" tokenizer that is not byte-level (a Metaspace BPE, as Llama-style ones): "▁is"
    is " is" after a word and "is" at the start of a text. bos <s> (0), eos </s> (1)."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from forge_ml.tokenizer import HFTokenizer, hf_tokenizer_spec

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    t.train_from_iterator(["Hello world, this is the test of a metaspace tokenizer; héllo again."] * 20,
                          trainers.BpeTrainer(vocab_size=90, special_tokens=["<s>", "</s>"],
                                              show_progress=False))
    spec = hf_tokenizer_spec(json.loads(t.to_str()), {"tokenizer_class": "PreTrainedTokenizerFast",
                                                      "bos_token": "<s>", "eos_token": "</s>"},
                             {"bos_token_id": 0, "eos_token_id": 1})
    return HFTokenizer(spec)


@pytest.fixture(scope="module")
def spaced():
    """``(tokenizer, model, ids, greedy tokens)``: a model whose greedy continuation of
    PROMPT begins with a token that has a space of its own after a word ("▁of"), and so
    loses it decoded alone (the first of a few seeds that does; checked, so no test below
    can pass on a continuation that has no such space)."""
    tok = metaspace_tokenizer()
    cfg = GPT2Config(vocab_size=tok.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=16)
    ids = tok.encode(PROMPT)
    for seed in range(40):
        model = make_model(cfg, seed=seed)
        out = list(generate(model, ids, 8, temperature=0))
        after = tok.decode(ids + out)[len(tok.decode(ids)):]
        if out[0] not in tok.stop_tokens and after.startswith(" ") and \
                not tok.decode(out).startswith(" ") and " " in after.strip():
            return tok, model, ids, out
    pytest.fail("no seed gave a continuation that starts with a spaced token")


def test_generate_text_keeps_the_space_a_metaspace_token_has_after_the_prompt(spaced):
    """generate_text is the text after the prompt, as transformers' pipeline and forge-ml
    sample give it: decode(prompt + new)[len(decode(prompt)):]. Decoding the new tokens alone
    dropped the first one's space ("Hello world" + "of ..." read "Hello worldof ...")."""
    tok, model, ids, out = spaced
    text = generate_text(model, tok, PROMPT, 8, temperature=0)
    assert text == tok.decode(ids + out)[len(tok.decode(ids)):]
    assert text.startswith(" ") and PROMPT + text == tok.decode(ids + out)


def test_a_stop_string_that_begins_with_the_space_is_found(spaced):
    """A stop string is looked for in that same text: " of", the start of the continuation,
    was never found (the row's text, decoded alone, began "of"), so generation ran to
    max_new_tokens."""
    tok, model, ids, out = spaced
    after = tok.decode(ids + out)[len(tok.decode(ids)):]
    stop = after[:after.index(" ", 1)] if " " in after[1:] else after   # the first word, spaced
    steps = list(generate(model, [ids], 8, temperature=0, stop_strings=[stop], tokenizer=tok))
    events = [e for s in steps for e in s]
    assert events[-1].finish == "stop_string" and len(events) < 8
    assert generate_text(model, tok, PROMPT, 8, temperature=0, stop_strings=stop) == ""


def test_sample_num_beams_prints_the_space_after_the_prompt(spaced, tmp_path, capsys):
    """forge-ml sample --num-beams prints the prompt and what decode gives after it, as the
    sampled path prints it; it printed the prompt and the new tokens decoded alone."""
    from forge_ml.checkpoint import save_checkpoint

    tok, model, ids, _ = spaced
    save_checkpoint(tmp_path / "ck", model.state_dict(),
                    {"config": model.config.to_dict(), "tokenizer": tok.to_dict()})
    seqs, _ = beam_search(model, ids, 8, 2, eos_token_id=list(tok.stop_tokens),
                          num_return_sequences=2)
    want = []
    for seq in seqs:
        new = [t for t in seq if t not in tok.stop_tokens]
        want.append(PROMPT + tok.decode(ids + new)[len(tok.decode(ids)):])
    assert any(w[len(PROMPT)] == " " for w in want)       # a spaced first token
    assert main(["sample", "--ckpt", str(tmp_path / "ck"), "--prompt", PROMPT,
                 "--max-new-tokens", "8", "--num-beams", "2", "--num-return-sequences", "2"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if not x.startswith("--- sequence")]
    assert lines == want


def test_generate_text_of_an_empty_prompt_starts_where_sample_starts():
    """An empty text prompt starts from the tokenizer's empty_prompt() (a newline for a char
    tokenizer, end-of-text for GPT-2's, bos for an hf one), as forge-ml sample does; it was
    generate's "the prompt is empty; give at least one token" error."""
    tok = CharTokenizer("abcdefghijklmnopqrstu \n")
    cfg = GPT2Config(vocab_size=tok.vocab_size, block_size=24, n_layer=1, n_head=2, n_embd=16)
    model = make_model(cfg, seed=1)
    start = tok.empty_prompt()
    out = list(generate(model, start, 6, temperature=0))
    text = generate_text(model, tok, "", 6, temperature=0)
    assert text == tok.decode(out) and len(text) == 6


def test_generate_text_of_a_model_padded_past_its_tokenizer_skips_the_extra_ids():
    """A model whose vocabulary is padded past its tokenizer's (nanoGPT's 50304 for GPT-2's
    50257) can draw an id the tokenizer has no text for: it adds no text, as forge-ml sample
    prints it and transformers decodes it. generate_text raised the tokenizer's "id 8 ... is
    out of range" mid-run, and so did generate with stop_strings."""
    tok = CharTokenizer("abcdef")
    model = make_model(GPT2Config(vocab_size=10, block_size=16, n_layer=1, n_head=1, n_embd=8),
                       seed=0)
    out = list(generate(model, [0, 1], 10, seed=0))
    assert any(t >= tok.vocab_size for t in out) and any(t < tok.vocab_size for t in out)
    want = tok.decode([t for t in out if t < tok.vocab_size])
    assert generate_text(model, tok, "ab", 10, seed=0) == want
    steps = generate(model, [[0, 1]], 10, seed=0, stop_strings="zz", tokenizer=tok)
    assert [e.token for s in steps for e in s] == out
