"""A QA pass over the ways a user asks the CPU for more memory than the host has, beyond
train's batch and serve's slots: generate's prompts (and one long prompt), beam_search's
beams, GPT2.init's sizes and new_cache's rows. Linux hands such arrays out and then kills the
process as they fill (exit 137, without a word); each is now refused at the call, with the
amounts and what to lower, unless FORGE_HOST_MEMORY_CHECK=off.

Every refusal is tested with a faked 1 GiB free and the allocation that would follow patched to
raise ``_Allocated``: a missing check fails the test instead of filling the host. The estimates
are compared with the peak RSS of small real runs in a subprocess."""
import importlib
import json
import subprocess
import sys

import numpy as np
import pytest

import forge_ml.errors
import forge_ml.models.gpt2 as gpt2
from forge_ml import flags
from forge_ml.errors import ConfigError
from forge_ml.inference.beam import beam_search
from forge_ml.inference.decode import host_decode_bytes
from forge_ml.inference.generate import generate
from forge_ml.models.gpt2 import GPT2, GPT2Config, config_params

# the modules (the package's names are the functions)
gen = importlib.import_module("forge_ml.inference.generate")
decode = importlib.import_module("forge_ml.inference.decode")
GIB = 1 << 30
BIG_VOCAB = GPT2Config(vocab_size=50257, block_size=64, n_layer=1, n_head=1, n_embd=8)


class _Allocated(Exception):
    """Raised where the call would allocate what the check is about."""


def _raise(*a, **k):
    raise _Allocated("the call went on to allocate")


@pytest.fixture
def one_gib_free(monkeypatch):
    monkeypatch.setattr(forge_ml.errors, "host_available_bytes", lambda: GIB)


@pytest.fixture
def no_decoder(monkeypatch, one_gib_free):
    """generate's cache and step (``held_decoder``) are never built."""
    monkeypatch.setattr(gen, "held_decoder", _raise)


# -- generate ---------------------------------------------------------------------------------


def test_generate_refuses_prompts_whose_logits_cannot_fit_before_allocating(no_decoder):
    model = GPT2.init(BIG_VOCAB)
    B = 100_000       # each row holds rows of the 50,304-id vocabulary: ~100 GB in all
    prompts = [[1, 2]] * B
    need = host_decode_bytes(BIG_VOCAB, B, 2, 2 + 16 - 1)
    with pytest.raises(ConfigError) as e:
        generate(model, prompts, 16, temperature=0)
    msg = str(e.value)
    assert msg.startswith(f"generate: 100,000 prompts of up to 2 tokens and 16 new ones would "
                          f"hold about {need / GIB:,.1f} GiB on the CPU, more than the 1.0 GiB "
                          f"this machine has free; "), msg
    fit = GIB // (need // B)
    assert f"give at most about {fit:,} prompts at a time" in msg
    assert "--max-new-tokens" in msg and "FORGE_HOST_MEMORY_CHECK=off" in msg
    assert "\n" not in msg
    # as many prompts as it says go on to allocate; so does any number with the check off
    with pytest.raises(_Allocated):
        next(generate(model, [[1, 2]] * fit, 16, temperature=0))
    with flags.override(FORGE_HOST_MEMORY_CHECK="off"), pytest.raises(_Allocated):
        next(generate(model, prompts, 16, temperature=0))


def test_generate_counts_the_penalties_rows(no_decoder):
    """Penalties and a logit bias keep more rows of the vocabulary a prompt: a batch that fits
    without them does not with them."""
    model = GPT2.init(BIG_VOCAB)
    plain = host_decode_bytes(BIG_VOCAB, 1, 2, 5)
    B = int(GIB // plain * 0.9)
    with pytest.raises(_Allocated):
        next(generate(model, [[1, 2]] * B, 4, temperature=0))
    with pytest.raises(ConfigError, match="generate: "):
        generate(model, [[1, 2]] * B, 4, temperature=0, presence_penalty=0.5)
    with pytest.raises(ConfigError, match="generate: "):
        generate(model, [[1, 2]] * B, 4, temperature=0, logit_bias={3: 1.0})


def test_generate_refuses_one_prompt_whose_attention_cannot_fit(no_decoder):
    """The prefill holds every head's scores over the prompt: a 100,000-token prompt of a
    model with that context is ~100 GB of them, one prompt alone."""
    cfg = GPT2Config(vocab_size=65, block_size=100_000, n_layer=1, n_head=1, n_embd=8)
    model = GPT2.init(cfg)
    with pytest.raises(ConfigError) as e:
        generate(model, [1] * 99_999, 1)
    msg = str(e.value)
    assert msg.startswith("generate: a prompt of 99,999 tokens and 1 new ones would hold"), msg
    assert "use a shorter prompt or a smaller max_new_tokens" in msg
    assert "prompts at a time" not in msg
    # nothing to generate: nothing allocated, nothing refused
    assert list(generate(model, [1] * 100_000, 0)) == []


def test_stream_tokens_is_checked_through_generate(no_decoder):
    from forge_ml.inference.generate import stream_tokens
    cfg = GPT2Config(vocab_size=65, block_size=100_000, n_layer=1, n_head=1, n_embd=8)
    with pytest.raises(ConfigError, match="^generate: a prompt of 99,999 tokens"):
        next(stream_tokens(GPT2.init(cfg), [1] * 99_999, 5))


# -- beam_search ------------------------------------------------------------------------------


def test_beam_search_refuses_beams_that_cannot_fit_before_allocating(one_gib_free,
                                                                     monkeypatch):
    model = GPT2.init(BIG_VOCAB)
    monkeypatch.setattr(model, "new_cache", _raise)
    with pytest.raises(ConfigError) as e:
        beam_search(model, [1, 2, 3], 8, num_beams=20_000)
    msg = str(e.value)
    assert msg.startswith("beam_search: 20,000 beams of a prompt of 3 tokens and 8 new ones "
                          "would hold about "), msg
    assert "more than the 1.0 GiB this machine has free; use at most about " in msg
    assert "beams (--num-beams)" in msg and "FORGE_HOST_MEMORY_CHECK=off" in msg
    fit = int(msg.split("use at most about ")[1].split()[0].replace(",", ""))
    assert 0 < fit < 20_000
    with pytest.raises(_Allocated):
        beam_search(model, [1, 2, 3], 8, num_beams=fit)
    with flags.override(FORGE_HOST_MEMORY_CHECK="off"), pytest.raises(_Allocated):
        beam_search(model, [1, 2, 3], 8, num_beams=20_000)


def test_beam_search_of_one_beam_is_checked_too(no_decoder):
    """One beam is greedy search through generate's loop, which has generate's sizes."""
    cfg = GPT2Config(vocab_size=65, block_size=100_000, n_layer=1, n_head=1, n_embd=8)
    with pytest.raises(ConfigError, match="^beam_search: 1 beams of a prompt of 99,999 tokens"):
        beam_search(GPT2.init(cfg), [1] * 99_999, 1, num_beams=1)


# -- GPT2.init, init_params, new_cache --------------------------------------------------------


def test_init_of_a_huge_config_is_refused_before_any_weight_is_drawn(one_gib_free,
                                                                    monkeypatch):
    monkeypatch.setattr(gpt2.np.random, "PCG64", _raise)
    cfg = GPT2Config(vocab_size=50257, n_layer=200, n_head=16, n_embd=4096)   # ~40B params
    n = config_params(cfg)
    with pytest.raises(ConfigError) as e:
        GPT2.init(cfg)
    msg = str(e.value)
    assert msg.startswith(f"GPT2.init: a model of {n:,} parameters (n_layer 200, n_embd 4096, "
                          f"padded_vocab_size 50,304, block_size 1,024) would hold about "), msg
    assert "use a smaller n_layer, n_embd, vocab_size or block_size" in msg
    with pytest.raises(ConfigError, match="^init_params: a model of "):
        gpt2.init_params(cfg)
    with flags.override(FORGE_HOST_MEMORY_CHECK="off"), pytest.raises(_Allocated):
        GPT2.init(cfg)
    # a model that fits is drawn as before
    monkeypatch.undo()
    small = GPT2Config(vocab_size=10, block_size=8, n_layer=1, n_head=1, n_embd=4)
    assert GPT2.init(small).num_params() == config_params(small)


def test_config_params_is_the_models_count():
    for cfg in (GPT2Config(vocab_size=50257, block_size=16, n_layer=2, n_head=2, n_embd=16),
                GPT2Config(vocab_size=65, block_size=8, n_layer=3, n_head=1, n_embd=8,
                           tied_head=False)):
        assert config_params(cfg) == GPT2.init(cfg).num_params()


def test_new_cache_refuses_rows_that_cannot_fit(one_gib_free, monkeypatch):
    model = GPT2.init(BIG_VOCAB)
    monkeypatch.setattr(decode, "zeros", _raise)
    with pytest.raises(ConfigError, match="^new_cache: a KV cache of 10,000,000 rows x 64 "
                                          "positions would hold about 38.1 GiB"):
        model.new_cache(10_000_000)
    with pytest.raises(_Allocated):
        model.new_cache(1000)


# -- the estimates against real runs ---------------------------------------------------------


_MEASURE = r"""
import json, sys, tracemalloc
from forge_ml.models.gpt2 import GPT2, GPT2Config
from forge_ml.inference.generate import generate
from forge_ml.inference.beam import beam_search

kind, cfg, B, T, new = json.loads(sys.argv[1])
model = GPT2.init(GPT2Config(**cfg))
list(generate(model, [[1, 2]], 2, temperature=0))    # kernels and code paths warm
tracemalloc.start()          # the arrays' peak (NumPy's too): what the estimates count
if kind == "generate":
    for _ in generate(model, [[(r + t) % 60 for t in range(T)] for r in range(B)], new,
                      temperature=0):
        pass
else:
    beam_search(model, [t % 60 for t in range(T)], new, B, early_stopping="never")
print(tracemalloc.get_traced_memory()[1])
"""


@pytest.mark.parametrize("kind,cfg,B,T,new", [
    # the vocabulary's rows dominate
    ("generate", dict(vocab_size=50257, block_size=64, n_layer=1, n_head=1, n_embd=16), 160, 4, 3),
    ("beam", dict(vocab_size=50257, block_size=64, n_layer=1, n_head=1, n_embd=16), 100, 4, 3),
    # the prefill's attention dominates
    ("generate", dict(vocab_size=65, block_size=512, n_layer=1, n_head=2, n_embd=32), 16, 500, 2),
])
def test_the_estimates_cover_a_real_runs_peak_within_twice_it(kind, cfg, B, T, new):
    real = int(subprocess.run([sys.executable, "-c", _MEASURE,
                               json.dumps([kind, cfg, B, T, new])],
                              capture_output=True, text=True, check=True).stdout)
    c = GPT2Config(**cfg)
    if kind == "generate":
        est = host_decode_bytes(c, B, T, T + new - 1)
    else:
        est = host_decode_bytes(c, B, T, T + new - 1, 11) + 2 * B * (T + new - 1) * c.n_embd * 4
    assert real > 20e6, real         # the run itself, not the noise of the process
    # (the traced peak, not the process's RSS: that counts the allocator's arenas and the
    # libraries' own buffers, 1 GB more in a fresh clone under pytest -n 2 than alone)
    assert real <= est <= 2 * real, (real, est)


def test_eval_refuses_a_batch_whose_forward_cannot_fit(one_gib_free, monkeypatch, tmp_path,
                                                       capsys):
    """forge-ml eval ran a --batch-size of windows through the model at once, however many:
    100,000 windows of 1,024 tokens asked for terabytes. Refused before the forward, in one
    line; a batch that fits runs."""
    from forge_ml.checkpoint import save_checkpoint
    from forge_ml.cli import main
    from forge_ml.data import write_shard
    chars = "abcdefgh"
    cfg = GPT2Config(vocab_size=len(chars), block_size=256, n_layer=1, n_head=1, n_embd=64)
    save_checkpoint(tmp_path / "c", GPT2.init(cfg).state_dict(),
                    {"config": cfg.to_dict(), "tokenizer": {"kind": "char", "chars": chars},
                     "step": 1})
    write_shard(tmp_path / "v.bin", np.arange(2_000_000) % len(chars))
    monkeypatch.setattr(GPT2, "loss", _raise)
    rc = main(["eval", "--ckpt", str(tmp_path / "c"), "--data", str(tmp_path / "v.bin"),
               "--batch-size", "5000"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "forge-ml eval: batches of 5,000 windows of 256 tokens would hold about" in err
    assert "(--batch-size)" in err and "FORGE_HOST_MEMORY_CHECK=off" in err
    with pytest.raises(_Allocated):
        main(["eval", "--ckpt", str(tmp_path / "c"), "--data", str(tmp_path / "v.bin"),
              "--batch-size", "8"])


def test_prepare_refuses_a_text_whose_tokenizing_cannot_fit(monkeypatch, tmp_path):
    """prepare read a text of many gigabytes and its ids (about 9x its size at the peak) until
    Linux killed it without a word. Refused before the text is read; a text that fits is
    prepared."""
    from forge_ml import data
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be\n" * 10_000)          # 190 KB
    monkeypatch.setattr(forge_ml.errors, "host_available_bytes", lambda: 1 << 20)   # 1 MiB free
    monkeypatch.setattr(data, "load_text", _raise)
    with pytest.raises(ConfigError, match=r"^prepare: tokenizing .*t\.txt \(0 MiB of text\) "
                                          r"would hold about .* split the text into smaller"):
        data.prepare(text, tmp_path / "out")
    assert data.PREPARE_BYTES_PER_TEXT_BYTE * text.stat().st_size > 1 << 20
    monkeypatch.setattr(forge_ml.errors, "host_available_bytes", lambda: 1 << 30)
    with pytest.raises(_Allocated):
        data.prepare(text, tmp_path / "out")
