"""Train tiny models under FSDP2 on CPU processes and save them, for tests/integration/distributed/test_full_weights.py (under torchrun).

`fsdp_save.py OUT STATE_DICT_TYPE`: with FULL_STATE_DICT a tiny Llama with tied embeddings trains 4 steps with a
checkpoint at step 2, then a second trainer resumes from that checkpoint, and a Mixtral's trainer is refused as it
is built (its save would fail); with SHARDED_STATE_DICT a tiny GPT-2 (compiled whole) trains, then a LoRA GPT-2.
Each trained model is saved by ``save_model`` (and once more split into several files), each folder first holding
the untrained model in the other layout (one file / split): stale files the save replaces. Rank 0 writes the
trained weights (``expected_*.pt``) and the losses (``result.json``) for the test to compare.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for tiny.py

import tiny  # noqa: E402
import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments  # noqa: E402
from optimum_gaudi.distributed import full_weights  # noqa: E402
from optimum_gaudi.errors import UserError  # noqa: E402


def arguments(out: Path, state_dict_type: str, layer: str, **overrides) -> GaudiTrainingArguments:
    fsdp_config = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": [layer], "state_dict_type": state_dict_type}
    settings = dict(
        output_dir=str(out), fsdp="full_shard auto_wrap", fsdp_config=fsdp_config, per_device_train_batch_size=4,
        max_steps=4, save_steps=2, logging_steps=1, learning_rate=1e-2, report_to="none", disable_tqdm=True,
        train_sampling_strategy="sequential", seed=0,
    )  # fmt: skip
    return GaudiTrainingArguments(**{**settings, **overrides})


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the model, whole (a gather on every rank)."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()
    }


def train_and_save(out: Path, name: str, model, args, resume=None) -> list[float]:
    plain = not full_weights.is_peft(model)
    rank0 = int(os.environ["RANK"]) == 0
    if plain:  # the untrained weights where the trained ones go, in the other layout: stale files to replace
        model.save_pretrained(str(out / name), is_main_process=rank0, max_shard_size="8KB")
        model.save_pretrained(str(out / f"{name}_split"), is_main_process=rank0)
    trainer = GaudiTrainer(model=model, args=args, train_dataset=tiny.lm_data())
    trainer.train(resume_from_checkpoint=resume)
    if name == "gpt2":
        assert isinstance(trainer.model, torch._dynamo.eval_frame.OptimizedModule), type(trainer.model)
    trainer.save_model(str(out / name))
    unwrapped = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    if plain:  # the same model once more, in several files
        full_weights.save_pretrained(unwrapped, str(out / f"{name}_split"), is_main_process=rank0, max_shard_size="8KB",
                                     host_group=args.parallel_layout.host_group())  # fmt: skip
    state = full_state(unwrapped)
    if trainer.is_world_process_zero():
        torch.save(state, out / f"expected_{name}.pt")
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def refused_at_build(out: Path) -> str | None:
    """The error of a trainer built for a model whose final save would fail (its weights converted on save)."""
    try:
        GaudiTrainer(model=tiny.mixtral(), args=arguments(out / "mixtral", "FULL_STATE_DICT", "MixtralDecoderLayer"))
    except UserError as error:
        return str(error)
    return None


def main() -> None:
    out, state_dict_type = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    result = {}
    if state_dict_type == "FULL_STATE_DICT":
        result["mixtral"] = refused_at_build(out)
        llama = dict(tie_word_embeddings=True, vocab_size=101)  # 51 rows on rank 0, 50 on rank 1
        result["whole"] = train_and_save(
            out, "llama", tiny.llama(**llama), arguments(out / "run", state_dict_type, "LlamaDecoderLayer")
        )
        checkpoint = str(out / "run" / "checkpoint-2")
        args = arguments(out / "resumed", state_dict_type, "LlamaDecoderLayer")
        result["resumed"] = train_and_save(out, "resumed", tiny.llama(seed=1, **llama), args, resume=checkpoint)
    else:
        from peft import LoraConfig, get_peft_model

        compiled = dict(torch_compile=True, torch_compile_backend="eager")  # whole: save_model sees through it
        args = arguments(out / "run", state_dict_type, "GPT2Block", max_steps=2, **compiled)
        result["whole"] = train_and_save(out, "gpt2", tiny.gpt2(**tiny.NO_DROPOUT), args)
        lora = get_peft_model(tiny.gpt2(**tiny.NO_DROPOUT), LoraConfig(r=4, target_modules=["c_attn"]))
        args = arguments(out / "lora_run", state_dict_type, "GPT2Block", max_steps=2)
        result["lora"] = train_and_save(out, "lora", lora, args)
    if torch.distributed.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    tiny.leave_process()


if __name__ == "__main__":
    main()
