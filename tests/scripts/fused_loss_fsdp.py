"""Under torchrun: train a tiny untied Llama with FSDP2, with and without --use_fused_linear_cross_entropy, with the
output layer in the root FSDP unit and as an FSDP unit of its own (eager, and with regional compilation, which
compiles the loss's chunk step); write rank 0's losses to a JSON file.

`fused_loss_fsdp.py OUT.json`; each setting trains from the same initial weights on the same batches.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for tiny.py

import tiny  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments  # noqa: E402
from optimum_gaudi.features import linear_cross_entropy as fused_loss  # noqa: E402

fused_loss.CHUNK_ELEMENTS = 5 * tiny.VOCAB  # 5-token chunks: the chunking itself is exercised


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tiny.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def train(out_dir: str, fused: bool, wrap: list[str], compiled: bool = False) -> list[float]:
    compile_flags = dict(torch_compile=True, use_regional_compilation=True, torch_compile_backend="aot_eager")
    args = GaudiTrainingArguments(
        **(compile_flags if compiled else {}),
        output_dir=out_dir, max_steps=4, logging_steps=1, report_to="none", save_strategy="no", learning_rate=1e-2,
        seed=0, per_device_train_batch_size=4, disable_tqdm=True, use_fused_linear_cross_entropy=fused,
        fsdp="full_shard auto_wrap", fsdp_config={"transformer_layer_cls_to_wrap": wrap},
    )  # fmt: skip
    trainer = GaudiTrainer(model=llama(), args=args, train_dataset=tiny.lm_data())
    losses = tiny.losses(trainer)
    head = trainer.model.lm_head.weight
    fused_hooks = fused_loss.FusedLinearCrossEntropy.of(trainer.model) if fused else None
    return {
        "losses": losses,
        "head_is_sharded": type(head).__name__ == "DTensor",
        "chunk_compiled": fused_hooks is not None and fused_hooks.compiled_chunk is not None,
    }


def main() -> None:
    torch.set_num_threads(1)
    out = sys.argv[1]
    results = {}
    for name, fused, wrap, compiled in [
        ("root", False, ["LlamaDecoderLayer"], False),
        ("root_fused", True, ["LlamaDecoderLayer"], False),
        ("own_unit_fused", True, ["LlamaDecoderLayer", "Linear"], False),
        ("own_unit_fused_compiled", True, ["LlamaDecoderLayer", "Linear"], True),  # regional, the chunk step too
    ]:
        results[name] = train(str(Path(out).parent / name), fused, wrap, compiled)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(results))
    tiny.leave_process()


if __name__ == "__main__":
    main()
