"""Op lists that give one op inputs of two dtypes are found before the first step, in one line (issue 19).

The case that made it an issue: Llama trained with an explicit bf16 list without scaled_dot_product_attention
(the 0.1 bundled llama.json) crashed at step 1 with the kernel's "Expected query, key, and value to have the
same dtype". Now the trainer runs one dummy forward under its autocast before training
(precision/op_list_check.py) and stops with one line naming the op and the config keys.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.errors import UserError, call_main
from optimum_gaudi.precision import op_list_check
from optimum_gaudi.precision.autocast import OpListAutocast
from optimum_gaudi.precision.op_list_check import OpListDtypeError, check_op_lists, op_list_problem
from optimum_gaudi.precision.op_lists import resolve_op_lists

# the bundled llama.json of 0.1: bf16 on the matmuls only
MATMULS_ONLY = {
    "use_torch_autocast": True,
    "autocast_bf16_ops": ["addmm", "baddbmm", "bmm", "linear", "matmul", "mm"],
    "autocast_fp32_ops": ["cross_entropy_loss", "embedding", "log_softmax", "nll_loss", "softmax"],
}


def llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    """Two layers, width 32, grouped-query attention (4 heads, 2 key-value heads)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def autocast(bf16_ops=None, fp32_ops=None):
    lists = OpListAutocast(*resolve_op_lists(bf16_ops, fp32_ops))
    return lambda: lists


def matmuls_only():
    return autocast(MATMULS_ONLY["autocast_bf16_ops"], MATMULS_ONLY["autocast_fp32_ops"])


def args(tmp_path, **kwargs):
    defaults = dict(output_dir=str(tmp_path), use_habana=True, max_steps=2, per_device_train_batch_size=4)
    defaults.update(logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True)
    return GaudiTrainingArguments(**{**defaults, **kwargs})


def test_llamas_attention_left_out_of_a_bf16_list_is_one_line_naming_the_op_and_the_keys():
    problem = op_list_problem(llama(), matmuls_only())
    assert problem is not None and "\n" not in problem
    assert "'scaled_dot_product_attention'" in problem and "autocast_bf16_ops" in problem
    assert "bfloat16 and float32" in problem and "Habana's default" in problem


def test_habanas_default_lists_and_a_list_with_attention_pass():
    assert op_list_problem(llama(), autocast()) is None
    with_attention = [*MATMULS_ONLY["autocast_bf16_ops"], "scaled_dot_product_attention", "mul"]
    assert op_list_problem(llama(), autocast(with_attention, MATMULS_ONLY["autocast_fp32_ops"])) is None


def test_the_trainer_stops_before_the_first_step(tmp_path, tiny_lm_data):
    config = tmp_path / "matmuls_only.json"
    config.write_text(json.dumps(MATMULS_ONLY))
    trainer = GaudiTrainer(model=llama(), args=args(tmp_path, bf16=True, gaudi_config_name=str(config)),
                           train_dataset=tiny_lm_data)  # fmt: skip
    with pytest.raises(OpListDtypeError) as excinfo:
        trainer.train()
    assert isinstance(excinfo.value, UserError) and "\n" not in str(excinfo.value)
    assert "scaled_dot_product_attention" in str(excinfo.value)
    assert trainer.state.global_step == 0 and trainer.optimizer is None  # nothing trained, nothing built


def test_a_script_prints_one_error_line_and_exits_2(tmp_path, tiny_lm_data, capsys):
    config = tmp_path / "matmuls_only.json"
    config.write_text(json.dumps(MATMULS_ONLY))

    def main(argv):
        arguments = args(tmp_path, bf16=True, gaudi_config_name=str(config))
        GaudiTrainer(model=llama(), args=arguments, train_dataset=tiny_lm_data).train()

    assert call_main(main, []) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "'scaled_dot_product_attention'" in errors[0] and "Traceback" not in errors[0]


def test_the_check_changes_no_loss_and_leaves_the_training_mode(tmp_path, tiny_lm_data, monkeypatch):
    def run(directory):
        trainer = GaudiTrainer(model=llama(), args=args(tmp_path / directory, bf16=True, gaudi_config_name="llama"),
                               train_dataset=tiny_lm_data)  # fmt: skip
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer

    checked, trainer = run("checked")
    assert trainer.model.__dict__.get(op_list_check._CHECKED) is trainer._precision.autocast  # it did run
    monkeypatch.setattr("optimum_gaudi.precision.plan.check_op_lists", lambda model, autocast: None)
    assert run("unchecked")[0] == checked
    model = llama().train()
    op_list_problem(model, autocast())
    assert model.training


def test_checked_once_per_model_and_autocast_and_never_on_a_compiled_model(monkeypatch):
    calls = []
    monkeypatch.setattr(op_list_check, "op_list_problem", lambda model, autocast: calls.append(model))
    model, lists = llama(), autocast()
    check_op_lists(model, lists)
    check_op_lists(model, lists)
    check_op_lists(model, None)  # no op-list autocast: nothing to check
    assert len(calls) == 1
    check_op_lists(model, autocast())  # another trainer's autocast
    assert len(calls) == 2
    compiled = llama()
    compiled.model.layers[0].compile()  # as --use_regional_compilation does; a new shape would recompile it
    check_op_lists(compiled, lists)
    check_op_lists(torch.compile(llama()), lists)
    assert len(calls) == 2


def test_a_model_no_dummy_batch_runs_is_not_checked():
    assert op_list_problem(torch.nn.Linear(2, 2), matmuls_only()) is None  # no config, no main input
    whisper = transformers.WhisperForConditionalGeneration(
        transformers.WhisperConfig(
            vocab_size=100,
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=3,
        )  # fmt: skip
    )
    assert op_list_problem(whisper, matmuls_only()) is None  # input_features: not one of ours


def test_the_dummy_batch_follows_the_models_head():
    def batches(model):
        return [
            {k: tuple(v.shape) for k, v in b.items() if k != "use_cache"} for b in op_list_check.dummy_batches(model)
        ]

    bert = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=64)  # fmt: skip
    classifier = transformers.BertForSequenceClassification(bert)
    assert batches(classifier)[0] == {"input_ids": (1, 8), "labels": (1, 8)}  # refused even without autocast...
    assert op_list_problem(classifier, matmuls_only()) is None  # ...so the next one, one label per row, decides
    vit = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                 image_size=16, patch_size=4)  # fmt: skip
    assert batches(transformers.ViTForImageClassification(vit))[0] == {"pixel_values": (1, 3, 16, 16), "labels": (1,)}
    audio = transformers.Wav2Vec2Config(
        vocab_size=12, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
    )  # fmt: skip
    ctc = transformers.Wav2Vec2ForCTC(audio)
    (first, *_) = batches(ctc)
    assert first == {"input_values": (1, 90), "labels": (1, 2)}  # 90 samples = 8 frames after both convolutions
    assert op_list_problem(ctc, autocast()) is None


def test_an_op_no_list_can_name_gets_the_general_advice():
    message = op_list_check._message("iadd", RuntimeError("result type Float can't be cast to BFloat16"))
    assert "'iadd'" in message and "same list" in message and "autocast_fp32_ops" in message
