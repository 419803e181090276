"""run_clm.py checks its memory plan from its arguments and the model's config before it reads any weight (issue
48): a run that cannot fit its card stops with one line and a non-zero status; a run that fits is not checked
again by the trainer. This CPU has no card, so one is stood in for (1 GB, less than a GPU's 2 GB reserve)."""

from __future__ import annotations

import transformers
from support import EXAMPLES, load_example
from tiny import llama

from optimum_gaudi.errors import EXIT_USER_ERROR, call_main
from optimum_gaudi.planning import Card
from optimum_gaudi.trainers import plan_check

SMALL_CARD = Card("a 1 GB test card", 1.0, None, None, 0.0, "test", "cuda")
LARGE_CARD = Card("a 1000 GB test card", 1000.0, None, None, 0.0, "test", "cuda")


def _clm():
    return load_example(EXAMPLES / "language-modeling" / "run_clm.py")


def test_a_run_that_cannot_fit_stops_in_one_line_before_its_weights_load(tmp_path, monkeypatch, capsys):
    clm = _clm()
    model = tmp_path / "model"
    llama().save_pretrained(model)
    clm.default_tokenizer().save_pretrained(model)
    (model / "model.safetensors").write_bytes(b"not weights")  # reading it would fail with another message
    loaded = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loaded.append(a))
    monkeypatch.setattr(plan_check, "card_of", lambda device: SMALL_CARD)

    status = call_main(clm.main, ["--model_name_or_path", str(model), "--do_train", "--block_size", "16",
                                  "--output_dir", str(tmp_path / "out"), "--report_to", "none"])  # fmt: skip

    err = capsys.readouterr().err.strip().splitlines()
    assert status == EXIT_USER_ERROR != 0
    assert err[-1].startswith("error: the plan says this run needs ") and "--ignore_plan" in err[-1]
    assert not any("Traceback" in line for line in err)
    assert loaded == []  # from_pretrained never called: no weight read


def test_a_run_checked_before_loading_is_not_checked_again_by_the_trainer(tmp_path, monkeypatch):
    clm = _clm()
    checks = []
    real = plan_check.check_run
    monkeypatch.setattr(plan_check, "check_run", lambda *a, **k: checks.append(a) or real(*a, **k))
    monkeypatch.setattr(plan_check, "card_of", lambda device: LARGE_CARD)

    status = call_main(clm.main, ["--model_type", "gpt2", "--config_overrides", "n_layer=1,n_embd=32,n_head=2",
                                  "--do_train", "--max_steps", "1", "--output_dir", str(tmp_path / "out"),
                                  "--report_to", "none"])  # fmt: skip

    assert status == 0
    assert len(checks) == 1  # before loading only; train() found the same model and sequence checked
