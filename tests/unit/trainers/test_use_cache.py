"""optimum-habana's scripts declare ``--use_cache`` in their ModelArguments; transformers 5 gave TrainingArguments a
``use_cache`` field too. The two parse in one HfArgumentParser, and ``GaudiTrainingArguments(use_cache=...)``
still means what it means on transformers 5 (issue 32, point 2)."""

import importlib
import sys
from dataclasses import dataclass, field

import pytest
from support import REPO
from transformers import HfArgumentParser, Trainer, TrainingArguments

from optimum_gaudi import GaudiSeq2SeqTrainingArguments, GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.trainers.use_cache import TRAINING_ARGUMENTS_HAVE_USE_CACHE

transformers_5 = pytest.mark.skipif(
    not TRAINING_ARGUMENTS_HAVE_USE_CACHE, reason="transformers 4's TrainingArguments has no use_cache"
)


@dataclass
class ModelArguments:
    """The field as optimum-habana's run_clm.py / run_lora_clm.py / run_summarization.py declare it."""

    model_name_or_path: str | None = None
    use_cache: bool = field(default=True, metadata={"help": "Whether the model returns its key/value cache."})


@pytest.mark.parametrize("args_class", [GaudiTrainingArguments, GaudiSeq2SeqTrainingArguments])
def test_a_scripts_own_use_cache_parses_beside_the_training_arguments(args_class, tmp_path):
    parser = HfArgumentParser((ModelArguments, args_class))
    model_args, training_args = parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--use_cache"])
    assert model_args.use_cache is True
    model_args, training_args = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cache", "False"]
    )
    assert model_args.use_cache is False
    assert getattr(training_args, "use_cache", False) is False  # transformers 5's default, untouched


@pytest.mark.parametrize("args_class", [GaudiTrainingArguments, GaudiSeq2SeqTrainingArguments])
@transformers_5
def test_use_cache_in_code_is_transformers_5s(args_class, tmp_path, tiny_gpt2):
    assert args_class(output_dir=str(tmp_path)).use_cache is TrainingArguments(output_dir=str(tmp_path)).use_cache
    args = args_class(output_dir=str(tmp_path), use_cache=True)
    assert args.use_cache is True
    assert args.to_dict()["use_cache"] is True
    model = tiny_gpt2()
    model.config.use_cache = False
    GaudiTrainer(model=model, args=args)
    assert model.config.use_cache is True  # the Trainer copies it into the model config, as transformers 5's


@transformers_5
def test_a_subclass_sees_use_cache_in_its_post_init(tmp_path):
    seen = []

    @dataclass
    class MyArguments(GaudiTrainingArguments):
        my_flag: bool = False

        def __post_init__(self):
            seen.append(self.use_cache)
            super().__post_init__()

    assert MyArguments(output_dir=str(tmp_path), use_cache=True, my_flag=True).use_cache is True
    assert seen == [True]


@transformers_5
def test_plain_trainer_with_transformers_arguments_is_unchanged(tmp_path, tiny_gpt2):
    """transformers' own TrainingArguments keeps its --use_cache option; only the Gaudi classes hold it back."""
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cache", "True"]
    )
    model = tiny_gpt2()
    Trainer(model=model, args=args)
    assert model.config.use_cache is True


def load_run_clm():
    """The example as the other examples import it (its folder on sys.path)."""
    folder = str(REPO / "examples" / "language-modeling")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module("run_clm")


@pytest.mark.parametrize(
    ("flags", "expected"), [([], None), (["--use_cache", "True"], True), (["--use_cache", "False"], False)]
)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_examples_use_cache_reaches_the_config_and_the_training_arguments(tmp_path, flags, expected, checkpointing):
    run_clm = load_run_clm()
    argv = ["--output_dir", str(tmp_path), *flags] + (["--gradient_checkpointing"] if checkpointing else [])
    model_args, _, training_args = run_clm.parse_args(argv)
    run_clm.settle_use_cache(model_args, training_args)
    if expected is not None:
        expected = expected and not checkpointing
    assert model_args.use_cache is expected
    if TRAINING_ARGUMENTS_HAVE_USE_CACHE:
        assert training_args.use_cache is bool(expected)  # unset: transformers 5's default, off
    config, _ = run_clm.load_config(model_args, run_clm.load_tokenizer(model_args))
    assert config.use_cache is (True if expected is None else expected)  # unset: the model config's own
