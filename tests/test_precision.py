import pytest
import torch
from torch import nn

from optimum_gaudi import GaudiConfig, GaudiConfigError, GaudiTrainer, GaudiTrainingArguments
from optimum_gaudi.devices import CPUDevice
from optimum_gaudi.precision import OpListAutocast


class LinearSoftmax(nn.Module):
    """Records the dtype each op produced during the forward pass."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.seen = {}

    def forward(self, x):
        h = self.proj(x)
        p = torch.softmax(h, dim=-1)
        q = h.float() @ p.float().T
        self.seen = {"linear": h.dtype, "softmax": p.dtype, "matmul": q.dtype}
        return p


def forward_under(factory):
    model = LinearSoftmax()
    with factory():
        model(torch.randn(4, 8))
    return model.seen


def test_listed_ops_run_in_their_dtype_and_nothing_else_changes():
    seen = forward_under(CPUDevice().autocast_factory(["linear"], ["softmax"]))
    assert seen == {"linear": torch.bfloat16, "softmax": torch.float32, "matmul": torch.float32}


def test_swapping_the_lists_swaps_the_dtypes():
    seen = forward_under(CPUDevice().autocast_factory(["softmax"], ["linear"]))
    assert seen["linear"] == torch.float32 and seen["softmax"] == torch.bfloat16


def test_matmul_operator_is_matched_by_name():
    seen = forward_under(CPUDevice().autocast_factory(["matmul"], []))
    assert seen == {"linear": torch.float32, "softmax": torch.float32, "matmul": torch.bfloat16}


def test_without_lists_torch_autocast_is_used():
    seen = forward_under(CPUDevice().autocast_factory(None, None))
    assert seen["linear"] == torch.bfloat16  # torch's built-in CPU list


def test_gradients_reach_fp32_parameters():
    model = LinearSoftmax()
    with OpListAutocast(["linear"], ["softmax"]):
        model(torch.randn(4, 8)).sum().backward()
    assert model.proj.weight.grad.dtype == torch.float32 and model.proj.weight.grad.abs().sum() > 0


def test_an_op_in_both_lists_is_an_error():
    with pytest.raises(GaudiConfigError, match="in both autocast_bf16_ops and autocast_fp32_ops"):
        GaudiConfig(autocast_bf16_ops=["linear"], autocast_fp32_ops=["linear"])
    with pytest.raises(ValueError, match="in both"):
        OpListAutocast(["mm"], ["mm"])


def test_trainer_uses_the_config_lists_inside_its_forward(tmp_path):
    config = GaudiConfig(use_torch_autocast=True, autocast_bf16_ops=["softmax"], autocast_fp32_ops=["linear"])
    args = GaudiTrainingArguments(output_dir=str(tmp_path), report_to=[], bf16=True)
    trainer = GaudiTrainer(model=LinearSoftmax(), args=args, gaudi_config=config)
    assert trainer.accelerator.mixed_precision == "no"  # accelerate's fixed lists would override ours
    with trainer.compute_loss_context_manager():
        trainer.model(torch.randn(2, 8))
    assert trainer.model.seen["softmax"] == torch.bfloat16 and trainer.model.seen["linear"] == torch.float32


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
