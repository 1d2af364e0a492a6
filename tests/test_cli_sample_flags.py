"""``forge-ml sample``: sampling flags with beam search, and log-probabilities at a vanishing
temperature (through ``main([...])``, on test_cli's tiny run)."""
import pytest

import test_cli
from forge_ml.cli import main
from test_cli import _fails

trained, workdir = test_cli.trained, test_cli.workdir     # its fixtures: a run trained 3 steps

BASE = ["sample", "--ckpt", "run", "--prompt", "to be", "--max-new-tokens", "4"]


@pytest.mark.parametrize("argv,got", [
    (["--temperature", "0.9"], "--temperature 0.9"),
    (["--temperature", "0.8"], "--temperature 0.8"),      # the default's value, given: refused too
    (["--top-k", "5"], "--top-k 5"),
    (["--top-p", "0.9"], "--top-p 0.9"),
    (["--min-p", "0.05"], "--min-p 0.05"),
])
def test_a_sampling_flag_with_num_beams_is_refused(trained, capsys, argv, got):
    # beam search (transformers' num_beams without do_sample) draws nothing: the flag was ignored
    _fails(capsys, BASE + ["--num-beams", "2", *argv],
                  "applies to sampled tokens; beam search (--num-beams) is deterministic and does "
                  "not take it: drop one or the other", f"got {got}")
    assert capsys.readouterr().out == ""


def test_several_sampling_flags_with_num_beams_are_named_together(trained, capsys):
    _fails(capsys, BASE + ["--num-beams", "2", "--temperature", "0.7", "--top-k", "40"],
           "--temperature and --top-k apply to sampled tokens", "does not take them",
           "drop them or --num-beams", "got --temperature 0.7 --top-k 40")


@pytest.mark.parametrize("extra", [
    [],                                                   # defaults: nothing given
    ["--temperature", "0"],                               # greedy: no sampling asked for
    ["--top-k", "0", "--top-p", "1", "--min-p", "0"],    # each flag's off value
    ["--seed", "7"],                                      # beam search draws nothing to seed
])
def test_num_beams_takes_defaults_and_off_values(trained, capsys, extra):
    assert main(BASE + ["--num-beams", "2", *extra]) == 0
    assert capsys.readouterr().out.startswith("to be")


def test_sampling_flags_without_beams_still_work(trained, capsys):
    assert main(BASE + ["--temperature", "0.9", "--top-k", "5", "--top-p", "0.9", "--min-p", "0.05"]) == 0
    assert capsys.readouterr().out.startswith("to be")


def test_logprobs_at_a_vanishing_temperature_are_clamped_as_the_server_does(trained, capsys):
    """At --temperature 1e-30 every token but the chosen one has a log-probability near -1e30
    (or -inf): the server writes -9999 for them, as OpenAI does; sample printed
    -198253110051155096873282912256.000."""
    pytest.importorskip("starlette")
    from forge_ml.inference import generate, load_model
    from forge_ml.inference.engine import shown_logprob
    n = 3
    assert main(BASE + ["--temperature", "1e-30", "--logprobs", str(n)]) == 0
    rows = capsys.readouterr().out.split("--- log-probabilities")[1].strip().splitlines()[1:]
    printed = [[float(r.split()[1])] + [float(a.rsplit(" ", 1)[1]) for a in r.split("   ", 1)[1].split(" | ")]
               for r in rows]
    model, tok, _ = load_model("run")
    events = [e for step in generate(model, [tok.encode("to be")], 4, temperature=1e-30, logprobs=n,
                                     stop_tokens=tuple(tok.stop_tokens))
              for e in step]
    want = [[round(shown_logprob(e.logprob), 3)] + [round(shown_logprob(lp), 3) for _, lp in e.top_logprobs]
            for e in events]
    assert printed == want
    assert min(v for row in printed for v in row) == -9999.0     # the clamp was exercised


def test_openai_penalties_and_logit_bias_flags(trained, capsys):
    """--presence-penalty, --frequency-penalty and --logit-bias reach generate: the printed
    text is generate's with the same settings (greedy), a bias of 100 on one id makes every
    new token that id, and the flags are refused with beam search and out of OpenAI's ranges."""
    from forge_ml.inference import generate, load_model
    model, tok, _ = load_model("run")
    z = tok.vocab_size - 1
    assert main(BASE + ["--temperature", "0", "--logit-bias", f"{z}:100"]) == 0
    assert capsys.readouterr().out.startswith("to be" + tok.decode([z]) * 4)
    argv = ["--temperature", "0", "--presence-penalty", "1.5", "--frequency-penalty", "0.5",
            "--logit-bias", f"{tok.encode('e')[0]}:-3"]
    assert main(BASE + argv) == 0
    out = capsys.readouterr().out
    want = list(generate(model, tok.encode("to be"), 4, temperature=0, presence_penalty=1.5,
                         frequency_penalty=0.5, logit_bias={tok.encode("e")[0]: -3},
                         stop_tokens=tuple(tok.stop_tokens)))
    assert out.startswith("to be" + tok.decode(want))


@pytest.mark.parametrize("argv,says", [
    (["--presence-penalty", "2.5"], "--presence-penalty must be a number in [-2, 2]"),
    (["--frequency-penalty", "-3"], "--frequency-penalty must be a number in [-2, 2]"),
    (["--logit-bias", "5"], "--logit-bias must be ID:BIAS"),
    (["--logit-bias", "a:1"], "--logit-bias must be ID:BIAS"),
    (["--logit-bias", "3:500"], "must be a number in [-100, 100]"),
    (["--logit-bias", "99999:1"], "logit_bias has token id 99999"),
    (["--logit-bias=-1:1"], "token id -1; token ids are 0 or more"),
    (["--logit-bias", "1_0:1"], "--logit-bias must be ID:BIAS"),     # int() reads it as 10
    (["--logit-bias", "\u0663:1"], "--logit-bias must be ID:BIAS"),   # an Arabic-Indic 3
    (["--logit-bias", "5:1", "--logit-bias", "5:-1"], "gives token 5 twice"),
    (["--num-beams", "2", "--frequency-penalty", "0.5"],
     "beam search (--num-beams) does not take it"),
])
def test_bad_openai_flags_are_refused(trained, capsys, argv, says):
    _fails(capsys, BASE + argv, says)
