"""What a Gaudi user exported stays the user's choice (issue 20, defect 11), on the simulated bridge (tests/fakes,
a test double)."""

import logging

import pytest
from conftest import GAUDI_SOFTWARE

from optimum_gaudi import GaudiConfig, GaudiTrainer, GaudiTrainingArguments

BOTH = pytest.mark.parametrize("gaudi_software", GAUDI_SOFTWARE, indirect=True)


def build(tmp_path, tiny_gpt2, config):
    args = GaudiTrainingArguments(output_dir=str(tmp_path), use_habana=True, report_to=[], save_strategy="no")
    return GaudiTrainer(model=tiny_gpt2(), args=args, gaudi_config=config)


@BOTH
def test_an_exported_dynamic_shapes_variable_is_not_overridden_by_the_config(
    tmp_path, tiny_gpt2, bridge, monkeypatch, caplog
):
    monkeypatch.setenv("PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES", "1")
    monkeypatch.setattr("optimum_gaudi.devices.hpu._warned", set())  # said once per process
    with caplog.at_level(logging.WARNING):
        build(tmp_path, tiny_gpt2, GaudiConfig(use_dynamic_shapes=False))
    import habana_frameworks.torch.hpu as hthpu

    assert hthpu.get_dynamic_shape_status()  # the bridge started from the exported value and kept it
    assert not bridge().calls_named("hpu.disable_dynamic_shape")
    assert sum("PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES=1 is exported" in r.getMessage() for r in caplog.records) == 1


@BOTH
def test_without_the_variable_the_config_decides(tmp_path, tiny_gpt2, bridge, monkeypatch):
    monkeypatch.delenv("PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES", raising=False)
    build(tmp_path, tiny_gpt2, GaudiConfig(use_dynamic_shapes=True))
    assert bridge().calls_named("hpu.enable_dynamic_shape")


def test_a_compile_mode_hpu_backend_ignores_is_said(tmp_path, bridge, caplog):
    with caplog.at_level(logging.WARNING):
        GaudiTrainingArguments(
            output_dir=str(tmp_path), use_habana=True, torch_compile_mode="max-autotune", report_to=[]
        )
    assert any("takes no mode" in r.getMessage() and "max-autotune" in r.getMessage() for r in caplog.records)
