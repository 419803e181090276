"""Instruction-tuning data for run_lora_clm.py: prompts, tokens, labels and batches.

Each row becomes a (source, target) pair: the prompt and the answer the model should learn to write. The
prompt follows one of three layouts, as in optimum-habana's run_lora_clm.py:

- Alpaca's (the default): instruction, optional input, then "### Response:";
- SQL (``--sql_prompt``): question and table context, answer between [SQL] tags;
- chat (``--chat_prompt``): the tokenizer's own chat template around a query and its content.

A dataset with a single column is plain text: an empty prompt and the text as the answer. Labels are the
tokens, with the prompt's tokens set to -100 unless ``--train_on_inputs``; padding gets -100 too, so neither
padding nor the prompt adds to the loss.
"""

from __future__ import annotations

from typing import Any

import datasets
from datasets import DatasetDict
from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerBase

IGNORE_INDEX = -100  # the label value transformers' losses skip

# The prompt texts (facts of the Alpaca and optimum-habana formats: a model tuned on one expects it).
ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
ALPACA_WITHOUT_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)
SQL_PROMPT = (
    "You are a text-to-SQL model. Your job is to answer questions about a database. "
    "You are given a question and a context regarding one or more tables in the database.\n\n"
    "You must output the SQL query that answers the question. The SQL query must be between [SQL] and [/SQL] tags.\n\n"
    "### Question: \n{instruction}\n\n### Context: \n{input}\n\n### Response:"
)
CHAT_REQUEST = (
    "Answer the below Query based on the Content given below. #### Query: {instruction} #### Content: {input}"
)


class DataError(ValueError):
    """The data does not fit the prompt layout asked for; the example reports it in one line."""


def prompt_columns(sql: bool, instruction: str | None, input: str | None, output: str | None) -> tuple[str, ...]:
    """The columns holding (instruction, input, output): the ones named, else the layout's defaults."""
    defaults = ("question", "context", "answer") if sql else ("instruction", "input", "output")
    return tuple(given or default for given, default in zip((instruction, input, output), defaults, strict=True))


def to_prompt_pairs(
    raw: DatasetDict,
    columns: tuple[str, ...],
    layout: str,
    tokenizer: PreTrainedTokenizerBase,
    source: str,
) -> DatasetDict:
    """Every split as ``source`` (the prompt) and ``target`` (the answer) columns; `layout` is "alpaca",
    "sql" or "chat". One column only: plain text, the whole of it the answer."""
    if layout == "chat" and not getattr(tokenizer, "chat_template", None):
        raise DataError("--chat_prompt needs a tokenizer with a chat template; this one has none.")
    instruction, input_, output = columns

    def pairs(split: datasets.Dataset) -> datasets.Dataset:
        names = split.column_names
        if len(names) == 1:
            return split.map(lambda rows: {"source": [""] * len(rows[names[0]]), "target": rows[names[0]]},
                             batched=True, remove_columns=names)  # fmt: skip
        for role, column in (("instruction", instruction), ("output", output)):
            if column not in names:
                flag = f"--{role}_column_name"
                raise DataError(
                    f"{source} has no column '{column}' for the {role} (its columns: {', '.join(names)}); "
                    f"name it with {flag}."
                )

        def build(rows: dict[str, list[Any]]) -> dict[str, list[str]]:
            count = len(rows[instruction])
            inputs = rows[input_] if input_ in rows else [""] * count
            sources = [
                _prompt(layout, str(rows[instruction][i]), "" if inputs[i] is None else str(inputs[i]), tokenizer)
                for i in range(count)
            ]
            return {"source": sources, "target": [str(text) for text in rows[output]]}

        return split.map(build, batched=True, remove_columns=names)

    return DatasetDict({name: pairs(split) for name, split in raw.items()})


def _prompt(layout: str, instruction: str, input_: str, tokenizer: PreTrainedTokenizerBase) -> str:
    fields = {"instruction": instruction, "input": input_}
    if layout == "sql":
        return SQL_PROMPT.format_map(fields)
    if layout == "chat":
        request = [{"role": "user", "content": CHAT_REQUEST.format_map(fields)}]
        return tokenizer.apply_chat_template(request, tokenize=False, add_generation_prompt=True)
    return (ALPACA_WITH_INPUT if input_ else ALPACA_WITHOUT_INPUT).format_map(fields)


def tokenize_pairs(
    pairs: DatasetDict,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    train_on_inputs: bool,
    chat: bool,
    **map_kwargs: Any,
) -> DatasetDict:
    """``input_ids``, ``attention_mask`` and ``labels`` of prompt + answer, cut at `max_length`, ending with
    the end-of-sequence token where there is room (so the model learns to stop). The prompt's labels are
    -100 unless `train_on_inputs`. A chat prompt already holds the template's special tokens, so no others
    are added to it. Rows left with no label at all (an answer cut off entirely) are dropped."""
    eos = tokenizer.eos_token_id

    def encode(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=not chat, truncation=True, max_length=max_length)["input_ids"]

    def tokenize(rows: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        ids = encode([s + t for s, t in zip(rows["source"], rows["target"], strict=True)])
        for row in ids:
            if eos is not None and len(row) < max_length and (not row or row[-1] != eos):
                row.append(eos)
        labels = [list(row) for row in ids]
        if not train_on_inputs:
            for label, prompt in zip(labels, encode(rows["source"]), strict=True):
                label[: len(prompt)] = [IGNORE_INDEX] * min(len(prompt), len(label))
        return {"input_ids": ids, "attention_mask": [[1] * len(row) for row in ids], "labels": labels}

    tokenized = pairs.map(tokenize, batched=True, remove_columns=["source", "target"], **map_kwargs)
    return DatasetDict(
        {
            name: split.filter(lambda row: any(label != IGNORE_INDEX for label in row["labels"]), **map_kwargs)
            for name, split in tokenized.items()
        }
    )


def concatenate(tokenized: DatasetDict, length: int, **map_kwargs: Any) -> DatasetDict:
    """Rows packed end to end and cut into rows of exactly `length` tokens (the remainder of each batch of
    1000 rows dropped): no padding, every token trains (``--dataset_concatenation``)."""

    def pack(rows: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        packed = {}
        for column, values in rows.items():
            flat = [token for row in values for token in row]
            packed[column] = [flat[i : i + length] for i in range(0, len(flat) - length + 1, length)]
        return packed

    return tokenized.map(pack, batched=True, **map_kwargs)


def collator(tokenizer: PreTrainedTokenizerBase, max_length: int | None) -> DataCollatorForSeq2Seq:
    """Right-pads a batch (labels with -100, attention mask with 0): to `max_length` where given (static
    shapes, for devices that compile a graph per shape), else to the longest row rounded up to 8."""
    return DataCollatorForSeq2Seq(
        tokenizer,
        padding="max_length" if max_length else "longest",
        max_length=max_length,
        pad_to_multiple_of=None if max_length else 8,
        label_pad_token_id=IGNORE_INDEX,
        return_tensors="pt",
    )
