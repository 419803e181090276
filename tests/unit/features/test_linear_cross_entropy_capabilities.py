"""The fused loss's capability checks on the torch each Gaudi release ships (2.6-2.10)."""

import torch

from optimum_gaudi.features import linear_cross_entropy as fused_loss


def test_a_torch_without_addmms_out_dtype_overload_accumulates_without_it(monkeypatch):
    """``aten::addmm.dtype_out`` came with torch 2.8: on 2.6 and 2.7 looking it up raises, which stopped every
    fused-loss run at step 1 ("operator aten::addmm.dtype_out does not exist")."""

    def missing(name, key):
        raise RuntimeError(f"operator {name} does not exist")

    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", missing)
    monkeypatch.setattr(fused_loss, "_MIXED_ADDMM", {})
    fused_loss._note_mixed_addmm(torch.device("cpu"))
    assert fused_loss._MIXED_ADDMM == {"cpu": False}
    total = torch.zeros(4, 3)
    a, b = torch.randn(4, 5, dtype=torch.bfloat16), torch.randn(5, 3, dtype=torch.bfloat16)
    fused_loss._accumulate(total, a, b)
    torch.testing.assert_close(total, (a @ b).float())
