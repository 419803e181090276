"""--torch_compile_mode / --torch_compile_backend turn compilation on before the Gaudi checks run (issue 9,
point 2): contradictions are refused however compilation was asked for, and a Gaudi compiles with hpu_backend."""

import logging

import pytest
from conftest import FALLBACK_DEVICE
from transformers import HfArgumentParser

from optimum_gaudi import GaudiArgumentError, GaudiTrainingArguments

COMPILE_WAYS = {
    "torch_compile": ["--torch_compile"],
    "mode": ["--torch_compile_mode", "reduce-overhead"],
    "backend": ["--torch_compile_backend", "inductor"],
    "mode+backend": ["--torch_compile_mode", "max-autotune", "--torch_compile_backend", "inductor"],
}
CONFLICTS = {
    "lazy": (["--use_lazy_mode"], "needs eager mode"),
    "training graphs": (["--use_hpu_graphs_for_training"], "cannot be combined with HPU Graphs"),
    "inference graphs": (["--use_hpu_graphs_for_inference"], "cannot be combined with HPU Graphs"),
    "lazy+training graphs": (["--use_lazy_mode", "--use_hpu_graphs_for_training"], "cannot be combined with HPU"),
}


def parse(tmp_path, *flags: str) -> GaudiTrainingArguments:
    (args,) = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none", *flags]
    )
    return args


@pytest.mark.parametrize("conflict", CONFLICTS)
@pytest.mark.parametrize("way", COMPILE_WAYS)
def test_every_way_of_asking_for_compilation_meets_the_same_checks(tmp_path, way, conflict):
    flags, message = CONFLICTS[conflict]
    with pytest.raises(GaudiArgumentError, match=message) as excinfo:
        parse(tmp_path, *COMPILE_WAYS[way], *flags)
    first_flag = COMPILE_WAYS[way][0]
    assert excinfo.value.args[0].startswith(first_flag)  # names the flag the user actually typed
    assert "\n" not in excinfo.value.args[0]


@pytest.mark.parametrize("way", ["torch_compile", "mode"])
def test_compilation_alone_is_accepted_with_the_device_backend(tmp_path, way):
    args = parse(tmp_path, *COMPILE_WAYS[way])
    assert args.torch_compile and args.torch_compile_backend == "inductor"  # CPU here


@pytest.mark.parametrize("way", ["torch_compile", "mode"])
def test_a_simulated_gaudi_compiles_with_hpu_backend(tmp_path, bridge, way):
    args = parse(tmp_path, "--use_habana", *COMPILE_WAYS[way])
    assert args.gaudi_device.type == "hpu"
    assert args.torch_compile and args.torch_compile_backend == "hpu_backend"
    if way == "mode":
        assert args.torch_compile_mode == "reduce-overhead"


def test_a_backend_the_user_names_is_kept_on_a_gaudi(tmp_path, bridge):
    args = parse(tmp_path, "--use_habana", "--torch_compile_backend", "eager")
    assert args.gaudi_device.type == "hpu" and args.torch_compile and args.torch_compile_backend == "eager"


def test_the_reported_combination_is_refused(tmp_path, bridge):
    with pytest.raises(
        GaudiArgumentError, match="--torch_compile_mode reduce-overhead .*cannot be combined with HPU Graphs"
    ):
        parse(
            tmp_path, "--use_habana", "--torch_compile_mode", "reduce-overhead",
            "--use_lazy_mode", "--use_hpu_graphs_for_training",
        )  # fmt: skip


def test_the_gaudis_compile_backend_on_an_optimum_habana_command_line_becomes_this_devices(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="optimum_gaudi"):
        args = GaudiTrainingArguments(
            output_dir=str(tmp_path), torch_compile=True, torch_compile_backend="hpu_backend", report_to=[]
        )
    assert args.torch_compile_backend == "inductor"
    here = FALLBACK_DEVICE.upper()  # no Gaudi: the device the run falls back to
    assert f"--torch_compile_backend hpu_backend is the Gaudi's; on {here} torch.compile uses inductor." in caplog.text
