#!/usr/bin/env python
"""Instruction tuning of a causal LM with PEFT adapters and GaudiTrainer, as optimum-habana's run_lora_clm.py.

Each row is a prompt (Alpaca's instruction / input layout, ``--sql_prompt`` or ``--chat_prompt``) and its answer;
the loss is on the answer (``--train_on_inputs`` for the prompt too); ``--dataset_concatenation`` packs rows into
``--max_seq_length`` blocks. Adapters: ``--peft_type`` lora (default), adalora, ia3, llama-adapter, vera or
ln_tuning; only they train, the base model stays frozen. With no data named it tunes on the embedded
instruction set (one-line summaries of Python's standard-library docstrings), offline; with no model, the model
`make demo` saved (outputs/demo). Needs PEFT: pip install "optimum-gaudi[peft]". Today's Gaudi default path,
eager mode + torch.compile:

    python examples/language-modeling/run_lora_clm.py --model_name_or_path PATH_TO_LLAMA --do_train --do_eval \
        --peft_type lora --lora_rank 8 --lora_target_modules q_proj v_proj --dataset_concatenation \
        --max_seq_length 512 --use_habana --gaudi_config_name llama --attn_implementation gaudi_fused_sdpa \
        --torch_compile --bf16 --output_dir /tmp/lora

Lazy mode (Gaudi software up to 1.20): ``--use_lazy_mode`` instead of ``--torch_compile``. The output directory
holds the adapter (adapter_model.safetensors, adapter_config.json), the tokenizer and gaudi_config.json; with
``--merge_lora`` also the merged full model in its merged/ folder. On a Gaudi or a GPU a LoRA run checks its
memory plan (frozen weights, the adapters' gradients and state, at ``--max_seq_length``) before the weights load:
one line where it cannot fit the card, ``--ignore_plan`` to train anyway.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import demo
import instruction_data
import run_clm
import transformers
from run_clm import UsageError
from transformers import PreTrainedModel

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.checkpoints import check_resume_before_data
from optimum_gaudi.data.tasks import instruction_datasets
from optimum_gaudi.errors import run_main
from optimum_gaudi.planning import Adapters
from optimum_gaudi.trainers.plan_check import check_plan_before_loading, weight_bytes_as_loaded

logger = logging.getLogger(__name__)

PEFT_TYPES = ("lora", "ia3", "adalora", "llama-adapter", "vera", "ln_tuning")
MERGEABLE = ("lora", "adalora", "ia3", "vera", "ln_tuning")  # PEFT folds these into the base weights
DEFAULT_MAX_SEQ_LENGTH = 512  # optimum-habana's
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


@dataclass
class ModelArguments(run_clm.ModelArguments):
    """run_clm.py's, plus optimum-habana's loading and Llama switches."""

    low_cpu_mem_usage: bool = field(
        default=False, metadata={"help": "Load weights without a second copy in host memory (transformers 4)."}
    )
    attn_softmax_bf16: bool = field(
        default=False, metadata={"help": "optimum-habana's Llama softmax in bf16; here attention runs in SDPA kernels."}
    )
    use_fused_rope: bool = field(
        default=True,
        metadata={"help": "Gaudi's fused rotary embedding where the Gaudi config enables it; false: never."},
    )
    load_meta_device: bool = field(
        default=False, metadata={"help": "optimum-habana: load straight to the device; here the trainer moves it."}
    )  # fmt: skip


@dataclass
class DataArguments(run_clm.DataTrainingArguments):
    """run_clm.py's data sources, cut into prompt + answer rows instead of text blocks."""

    max_seq_length: int | None = field(
        default=None,
        metadata={"help": "Tokens per row, longer rows cut: default 512, or the model's positions if fewer."},
    )
    dataset_concatenation: bool = field(
        default=False, metadata={"help": "Pack rows end to end into --max_seq_length blocks (no padding)."}
    )
    pad_to_max_length: bool = field(
        default=False,
        metadata={"help": "Pad every batch to --max_seq_length (done anyway where the device compiles a graph "
                  "per shape); else to the longest row, rounded up to 8."},
    )  # fmt: skip
    sql_prompt: bool = field(default=False, metadata={"help": "Text-to-SQL prompt: question, context, answer."})
    chat_prompt: bool = field(default=False, metadata={"help": "Prompt through the tokenizer's chat template."})
    instruction_column_name: str | None = field(
        default=None,
        metadata={"help": "Column of the instruction (default: instruction; with --sql_prompt: question)."},
    )
    input_column_name: str | None = field(
        default=None, metadata={"help": "Column of the optional input (default: input; with --sql_prompt: context)."}
    )
    output_column_name: str | None = field(
        default=None, metadata={"help": "Column of the answer (default: output; with --sql_prompt: answer)."}
    )
    save_last_ckpt: bool = field(
        default=True, metadata={"help": "Write a checkpoint at the end of training (as optimum-habana does)."}
    )
    dataset_seed: int = field(default=42, metadata={"help": "Seed of the held-out validation split."})
    keep_in_memory: bool = field(default=False, metadata={"help": "Keep the processed rows in memory, not cached."})
    dataset_cache_directory: str | None = field(
        default=None, metadata={"help": "Save the processed rows here; when it holds them, load them instead."}
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size is not None:
            raise UsageError("--block_size is run_clm.py's; run_lora_clm.py cuts rows at --max_seq_length.")
        if self.max_seq_length is not None and self.max_seq_length < 2:
            raise UsageError(f"--max_seq_length must be >= 2, got {self.max_seq_length}.")
        if self.sql_prompt and self.chat_prompt:
            raise UsageError("choose one of --sql_prompt and --chat_prompt.")

    @property
    def layout(self) -> str:
        return "sql" if self.sql_prompt else "chat" if self.chat_prompt else "alpaca"


@dataclass
class FinetuneArguments:
    """The adapters: which kind (--peft_type) and its settings."""

    peft_type: str = field(default="lora", metadata={"help": "Adapter kind.", "choices": list(PEFT_TYPES)})
    lora_rank: int = field(default=8, metadata={"help": "Rank of the LoRA update matrices."})
    lora_alpha: float = field(default=16, metadata={"help": "LoRA/AdaLoRA scale numerator: alpha / rank."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA/AdaLoRA path."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Modules LoRA/AdaLoRA adapt, e.g. q_proj v_proj (Llama) or c_attn (GPT-2). "
                  "Default: PEFT's choice for the model type."},
    )  # fmt: skip
    train_on_inputs: bool = field(default=True, metadata={"help": "Loss on the prompt too; false: on the answer only."})
    adalora_init_r: int = field(default=12, metadata={"help": "AdaLoRA: initial rank."})
    adalora_target_r: int = field(default=4, metadata={"help": "AdaLoRA: average rank it prunes to."})
    adalora_tinit: int = field(default=50, metadata={"help": "AdaLoRA: warm-up steps before pruning."})
    adalora_tfinal: int = field(default=100, metadata={"help": "AdaLoRA: final steps at the pruned ranks."})
    adalora_delta_t: int = field(default=10, metadata={"help": "AdaLoRA: steps between rank reallocations."})
    adalora_orth_reg_weight: float = field(default=0.5, metadata={"help": "AdaLoRA: orthogonality penalty weight."})
    ia3_target_modules: list[str] | None = field(default=None, metadata={"help": "IA3: modules to scale."})
    feedforward_modules: list[str] | None = field(
        default=None, metadata={"help": "IA3: which of them are feed-forward (scaled on their input)."}
    )
    adapter_layers: int = field(default=30, metadata={"help": "llama-adapter: layers (from the top) adapted."})
    adapter_len: int = field(default=10, metadata={"help": "llama-adapter: adaption prompt tokens per layer."})
    vera_target_modules: list[str] | None = field(default=None, metadata={"help": "VeRA: modules to adapt."})
    ln_target_modules: list[str] | None = field(default=None, metadata={"help": "LN tuning: norm modules to tune."})
    merge_lora: bool = field(
        default=False, metadata={"help": "After training, also save the base model with the adapter merged in."}
    )

    def __post_init__(self) -> None:
        if self.peft_type not in PEFT_TYPES:  # a JSON arguments file bypasses argparse's choices
            raise UsageError(f"--peft_type {self.peft_type!r}: choose one of {', '.join(PEFT_TYPES)}.")
        if self.lora_rank < 1:
            raise UsageError(f"--lora_rank must be >= 1, got {self.lora_rank}.")
        if not 0 <= self.lora_dropout < 1:
            raise UsageError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}.")
        if self.merge_lora and self.peft_type not in MERGEABLE:
            raise UsageError(f"--merge_lora: PEFT cannot merge {self.peft_type} adapters into the model.")


def peft_config(args: FinetuneArguments) -> Any:
    """The PEFT configuration --peft_type names, for a causal LM."""
    import peft

    common = {"task_type": peft.TaskType.CAUSAL_LM}
    if args.peft_type == "lora":
        return peft.LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                               target_modules=args.lora_target_modules, bias="none", **common)  # fmt: skip
    if args.peft_type == "adalora":
        return peft.AdaLoraConfig(
            init_r=args.adalora_init_r, target_r=args.adalora_target_r, tinit=args.adalora_tinit,
            tfinal=args.adalora_tfinal, deltaT=args.adalora_delta_t, orth_reg_weight=args.adalora_orth_reg_weight,
            lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, target_modules=args.lora_target_modules,
            bias="none", **common,  # no total_step: the trainer sets the run's step count when training starts
        )  # fmt: skip
    if args.peft_type == "ia3":
        return peft.IA3Config(target_modules=args.ia3_target_modules, feedforward_modules=args.feedforward_modules,
                              **common)  # fmt: skip
    if args.peft_type == "llama-adapter":
        return peft.AdaptionPromptConfig(adapter_layers=args.adapter_layers, adapter_len=args.adapter_len, **common)
    if args.peft_type == "vera":
        return peft.VeraConfig(target_modules=args.vera_target_modules, init_weights=False, **common)
    return peft.LNTuningConfig(target_modules=args.ln_target_modules, **common)


def default_base_model(model_args: run_clm.ModelArguments) -> None:
    """With no model named, adapt the one `make demo` trained; say how to get it when it is missing."""
    if model_args.model_name_or_path or model_args.model_type or model_args.config_name:
        return
    saved = demo.saved_model_dir()
    if not (saved / "config.json").is_file():
        raise UsageError(f"no model at {saved}: run `make demo` to train one there, or pass --model_name_or_path.")
    model_args.model_name_or_path = str(saved)


def add_adapters(model: PreTrainedModel, args: FinetuneArguments, gradient_checkpointing: bool) -> Any:
    """The model frozen, with the adapters --peft_type names."""
    if importlib.util.find_spec("peft") is None:
        raise UsageError("PEFT adapters need PEFT: pip install 'optimum-gaudi[peft]'.")
    from peft import get_peft_model

    if gradient_checkpointing:  # checkpointed blocks of a frozen model need inputs that require grad
        model.enable_input_require_grads()
    try:
        peft_model = get_peft_model(model, peft_config(args))
    except (ValueError, KeyError, NotImplementedError) as e:  # unknown targets, a model type PEFT lacks defaults for
        raise UsageError(f"{args.peft_type}: {str(e).strip().strip(chr(39)).splitlines()[0]}") from None
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    logger.info("%s adapters: %d trainable parameters of %d (%.2f%%).", args.peft_type, trainable, total,
                100 * trainable / total)  # fmt: skip
    return peft_model


def planned_adapters(args: FinetuneArguments, model_args: ModelArguments, config: Any) -> Adapters | None:
    """The LoRA adapters as the memory planner counts them; None for the other kinds, which it does not count."""
    if args.peft_type != "lora":
        return None
    frozen = weight_bytes_as_loaded(config, model_args.torch_dtype, pretrained=bool(model_args.model_name_or_path))
    return Adapters(args.lora_rank, tuple(args.lora_target_modules or ()), args.lora_dropout > 0, frozen)


def say_what_does_not_apply(model_args: ModelArguments) -> None:
    """One line for each optimum-habana switch that has no effect here, and why."""
    if model_args.attn_softmax_bf16:
        logger.warning("--attn_softmax_bf16 has no effect: attention's softmax runs inside the SDPA kernel "
                       "(--attn_implementation sdpa or gaudi_fused_sdpa; on a Gaudi see --flash_attention_fast_softmax).")  # fmt: skip
    if model_args.load_meta_device:
        logger.warning("--load_meta_device has no effect: the model loads on the host and the trainer moves it.")
    if model_args.low_cpu_mem_usage and TRANSFORMERS_5:
        logger.warning("--low_cpu_mem_usage has no effect: transformers >= 5 always loads weights this way.")


def fit_max_seq_length(requested: int | None, config: Any) -> int:
    """--max_seq_length, or 512 capped at the model's positions; one line when a given one is too long."""
    key, limit = run_clm.position_limit(config)
    if requested is None:
        return min(DEFAULT_MAX_SEQ_LENGTH, limit or DEFAULT_MAX_SEQ_LENGTH)
    if limit is not None and requested > limit:
        raise UsageError(f"--max_seq_length {requested} is longer than the model's {key}={limit}; lower it.")
    return requested


def load_rows(data_args: DataArguments, model_args: ModelArguments, do_eval: bool) -> datasets.DatasetDict:
    """Train (and validation) rows: the embedded instruction set, a dataset or local files; a validation split
    held out of train (--validation_split_percentage, --dataset_seed) where there is none."""
    fraction = data_args.validation_split_percentage / 100
    if data_args.uses_default_corpus:
        raw = instruction_datasets(validation_fraction=fraction or 0.05, seed=data_args.dataset_seed)
    else:
        raw = run_clm.with_validation_split(
            run_clm.load_named_data(data_args, model_args),
            data_args.validation_split_percentage,
            data_args.dataset_seed,
        )
    if data_args.text_column_name:  # plain text from a named column
        raw = raw.select_columns([data_args.text_column_name])
    if do_eval and "validation" not in raw:
        raise UsageError("--do_eval needs validation data: --validation_file or --validation_split_percentage > 0.")
    return raw


def prepare_rows(
    raw: datasets.DatasetDict, data_args: DataArguments, finetune_args: FinetuneArguments, tokenizer: Any
) -> datasets.DatasetDict:
    """Prompts, tokens and labels (packed with --dataset_concatenation), or those --dataset_cache_directory holds."""
    cache = Path(data_args.dataset_cache_directory) if data_args.dataset_cache_directory else None
    if cache is not None and (cache / "dataset_dict.json").is_file():
        logger.info("Processed rows loaded from %s", cache)
        return datasets.load_from_disk(str(cache))
    source = data_args.train_file or data_args.dataset_name or "the embedded instruction set"
    map_kwargs = {"num_proc": data_args.preprocessing_num_workers, "keep_in_memory": data_args.keep_in_memory,
                  "load_from_cache_file": not data_args.overwrite_cache}  # fmt: skip
    columns = instruction_data.prompt_columns(data_args.sql_prompt, data_args.instruction_column_name,
                                              data_args.input_column_name, data_args.output_column_name)  # fmt: skip
    try:
        pairs = instruction_data.to_prompt_pairs(raw, columns, data_args.layout, tokenizer, source)
    except instruction_data.DataError as e:
        raise UsageError(str(e)) from None
    rows = instruction_data.tokenize_pairs(pairs, tokenizer, data_args.max_seq_length, finetune_args.train_on_inputs,
                                           data_args.chat_prompt, **map_kwargs)  # fmt: skip
    if data_args.dataset_concatenation:
        rows = instruction_data.concatenate(rows, data_args.max_seq_length, **map_kwargs)
    for split, part in rows.items():
        if len(part) == 0:
            what = (
                f"--max_seq_length={data_args.max_seq_length} tokens"
                if data_args.dataset_concatenation
                else "an answer"
            )
            raise UsageError(f"the {split} data holds no row with {what}; give more data or lower --max_seq_length.")
    if cache is not None:
        rows.save_to_disk(str(cache))
    return rows


def build(
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: GaudiTrainingArguments,
    finetune_args: FinetuneArguments,
) -> GaudiTrainer:
    """Tokenizer, model with adapters, prompt rows and a ready GaudiTrainer."""
    if not (training_args.do_train or training_args.do_eval):
        raise UsageError("nothing to do: add --do_train and/or --do_eval.")
    default_base_model(model_args)
    run_clm.check_hub_names(model_args, data_args)
    say_what_does_not_apply(model_args)
    logger.info("Device: %s", training_args.gaudi_device.describe())
    transformers.set_seed(training_args.seed)
    tokenizer = run_clm.load_tokenizer(model_args)
    tokenizer.padding_side = "right"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    config, _ = run_clm.load_config(model_args, tokenizer)
    loading = {"low_cpu_mem_usage": True} if model_args.low_cpu_mem_usage and not TRANSFORMERS_5 else {}
    data_args.max_seq_length = fit_max_seq_length(data_args.max_seq_length, config)
    adapters = planned_adapters(finetune_args, model_args, config)
    if training_args.do_train and adapters is not None:  # a LoRA run that cannot fit its card: one line, no loading
        check_plan_before_loading(config, training_args, data_args.max_seq_length, adapters)
    model = run_clm.load_model(model_args, config, tokenizer, **loading)
    model = add_adapters(model, finetune_args, training_args.gradient_checkpointing)
    check_resume_before_data(training_args, model)  # a checkpoint of other adapters, before any data is read

    raw = load_rows(data_args, model_args, training_args.do_eval)
    logger.info("Rows: %s", {split: len(rows) for split, rows in raw.items()})
    with training_args.main_process_first(desc="tokenizing"):
        rows = prepare_rows(raw, data_args, finetune_args, tokenizer)
    logger.info("Tokenized rows: %s", {split: len(part) for split, part in rows.items()})

    def take(split: str, limit: int | None) -> datasets.Dataset:
        return rows[split].select(range(min(limit, len(rows[split])))) if limit else rows[split]

    static = data_args.pad_to_max_length or training_args.gaudi_device.static_shapes(training_args.use_lazy_mode)
    trainer = GaudiTrainer(
        model=model,
        args=training_args,
        train_dataset=take("train", data_args.max_train_samples) if training_args.do_train else None,
        eval_dataset=take("validation", data_args.max_eval_samples) if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=instruction_data.collator(tokenizer, data_args.max_seq_length if static else None),
    )
    if not model_args.use_fused_rope:
        trainer.gaudi_config.use_fused_rope = False
    return trainer


def main(argv: list[str] | None = None) -> dict[str, float]:
    after_training: list[tuple[DataArguments, FinetuneArguments]] = []

    def build_and_remember(model_args, data_args, training_args, finetune_args) -> GaudiTrainer:
        after_training.append((data_args, finetune_args))
        return build(model_args, data_args, training_args, finetune_args)

    def train_evaluate_and_merge(trainer: GaudiTrainer) -> dict[str, float]:
        data_args, finetune_args = after_training[0]
        metrics = run_clm.train_and_evaluate(trainer)  # saves the adapter, tokenizer and gaudi_config.json
        args = trainer.args
        if args.do_train and data_args.save_last_ckpt and not _checkpoint_of_last_step(trainer).is_dir():
            trainer._save_checkpoint(trainer.model, trial=None)  # crash-safe, as every checkpoint here
        if finetune_args.merge_lora and args.should_save:
            merged = Path(args.output_dir) / "merged"
            trainer.model.merge_and_unload().save_pretrained(merged)
            trainer.processing_class.save_pretrained(merged)
            trainer.gaudi_config.save_pretrained(merged)
            logger.info("Merged model saved to %s", merged)
        return metrics

    groups = (ModelArguments, DataArguments, GaudiTrainingArguments, FinetuneArguments)
    return run_clm.run_example(argv, groups, build_and_remember, train_evaluate_and_merge)


def _checkpoint_of_last_step(trainer: GaudiTrainer) -> Path:
    return Path(trainer.args.output_dir) / f"checkpoint-{trainer.state.global_step}"


if __name__ == "__main__":
    run_main(main)
