"""The op-list autocast in whole trainings: GPT-2 compiles under the lists without graph breaks, and under a bundled
config trains close to fp32. The op lists themselves, in process: tests/unit/precision/test_precision.py."""

import pytest
import torch
import torch._dynamo

from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.precision.autocast import OpListAutocast


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_gpt2_compiles_under_the_lists_without_graph_breaks(tiny_gpt2):
    model = tiny_gpt2()
    model.loss_type = "ForCausalLM"  # else transformers warns inside forward: a graph break of its own
    ids = torch.randint(0, 100, (2, 16))
    with OpListAutocast(["addmm", "mm", "matmul", "linear", "bmm", "baddbmm"], ["softmax", "layer_norm"]):
        explanation = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
        eager_loss = model(input_ids=ids, labels=ids).loss
        compiled_loss = torch.compile(model, backend="aot_eager")(input_ids=ids, labels=ids).loss
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-2, atol=1e-2)


def test_gpt2_under_bundled_config_trains_close_to_fp32(tiny_gpt2, tiny_lm_data, tmp_path):
    def losses(**kwargs):
        args = GaudiTrainingArguments(
            output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=8, learning_rate=1e-3,
            logging_steps=1, report_to=[], save_strategy="no", seed=0, **kwargs,
        )  # fmt: skip
        trainer = GaudiTrainer(model=tiny_gpt2(), args=args, train_dataset=tiny_lm_data)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    fp32 = losses()
    bf16 = losses(gaudi_config_name="gpt2")
    assert fp32[-1] < fp32[0]  # it learns
    assert bf16 != fp32
    assert bf16 == pytest.approx(fp32, abs=0.03)
