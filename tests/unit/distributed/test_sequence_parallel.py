"""--context_parallel_size: a batch whose sequences are split over 2 and over 4 ranks trains the tiny Llama as the
same batch on one process (losses and trained weights), with padding and gradient accumulation; on CPU over
gloo (one torchrun launch, several runs) and on the simulated Gaudi over hccl with gaudi_fused_sdpa.

The trainings on several ranks: tests/integration/distributed/test_sequence_parallel_trainings.py."""

import pytest
import tiny

from optimum_gaudi import GaudiTrainingArguments


def test_combinations_that_cannot_split_are_one_line(monkeypatch, tmp_path):
    from optimum_gaudi.distributed.layout import argument_problem

    args = GaudiTrainingArguments(output_dir=str(tmp_path))
    for given, expected in [
        (dict(attn_implementation="flash_attention_2"), "runs attention with sdpa, eager or gaudi_fused_sdpa, not"),
        (dict(use_hpu_graphs_for_training=True), "cannot be combined with --use_hpu_graphs_for_training"),
        (dict(label_smoothing_factor=0.1), "cannot be combined with --label_smoothing_factor (it reads the slice's"),
    ]:
        for name, value in {"context_parallel_size": 2, **given}.items():
            monkeypatch.setattr(args, name, value)
        assert expected in argument_problem(args, world_size=4)
        monkeypatch.undo()
    monkeypatch.setattr(args, "context_parallel_size", 2)
    assert argument_problem(args, world_size=4) is None
    monkeypatch.setattr(args, "torch_compile", True)  # the all-to-all compiles (tested with the commands)
    assert argument_problem(args, world_size=4) is None


def test_a_model_whose_heads_or_attention_cannot_split_is_one_line():
    from optimum_gaudi.distributed.sequence_parallel import model_problem

    model = tiny.llama_8_heads()  # 8 query, 4 key/value heads, sdpa
    assert model_problem(model, 4) is None
    assert model_problem(model, 8) == (
        "--context_parallel_size 8 gives each process 1/8 of the attention heads: the model has 8 query and 4 "
        "key/value heads; choose a size that divides both."
    )
    model.config.sliding_window = 8
    assert "sliding window" in model_problem(model, 2)
    model.config.sliding_window = None
    model.config._attn_implementation = "flash_attention_2"
    assert "the model uses flash_attention_2" in model_problem(model, 2)


def test_an_encoder_is_refused_in_one_line():
    """A bidirectional model would get a causal mask over the whole sequence: refused where the model is wrapped."""
    from transformers import BertConfig, BertForMaskedLM

    from optimum_gaudi.distributed.sequence_parallel import SequenceParallel
    from optimum_gaudi.errors import UserError

    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=8)
    bert = BertForMaskedLM(BertConfig(vocab_size=tiny.VOCAB, max_position_embeddings=64, **sizes))
    split = SequenceParallel(2, group=None, data_parallel_size=1, data_parallel_index=0)  # no process group
    with pytest.raises(UserError) as refused:
        split.use(bert)
    assert str(refused.value) == (
        "--context_parallel_size 2 splits causal (decoder) models only; this model has bidirectional attention "
        "(an encoder)."
    )
    assert not bert.config._attn_implementation.startswith("gaudi_sequence_parallel")  # left as it was


def test_transformers_parallelism_config_that_disagrees_is_one_line(tmp_path):
    from accelerate import ParallelismConfig

    from optimum_gaudi.distributed.layout import argument_problem

    args = GaudiTrainingArguments(output_dir=str(tmp_path))
    args.context_parallel_size, args.parallelism_config = 2, ParallelismConfig(sp_size=2)
    assert "parallelism_config split the sequences differently" in argument_problem(args, world_size=2)
    args.parallelism_config = ParallelismConfig(cp_size=2)  # what a CUDA run under FSDP gets: torch's path
    assert argument_problem(args, world_size=2) is None


def test_cuda_under_fsdp_takes_transformers_context_parallel_path(tmp_path, monkeypatch):
    """Where torch's context parallelism shards the device's SDPA (CUDA) and FSDP2 runs, --context_parallel_size
    becomes transformers' parallelism_config (FSDP over world / N, cp N): the layout's one choice."""
    from optimum_gaudi.devices import CPUDevice, CUDADevice
    from optimum_gaudi.distributed.layout import CP_ALL_TO_ALL, CP_TORCH, ParallelLayout

    assert CUDADevice.torch_context_parallel and not CPUDevice.torch_context_parallel
    args = GaudiTrainingArguments(output_dir=str(tmp_path))
    args.context_parallel_size, args.fsdp, args.gaudi_device = 4, "full_shard", CUDADevice()
    layout = ParallelLayout.from_arguments(args, world_size=8)
    assert (layout.cp_implementation, layout.data_parallel_size, layout.dp_shard_size) == (CP_TORCH, 2, 2)
    config = layout.parallelism_config()
    assert (config.cp_size, config.dp_shard_size, config.total_size) == (4, 2, 8)
    args.gaudi_device = CPUDevice()  # no sharding rule for its kernels: ours, FSDP over the whole world
    layout = ParallelLayout.from_arguments(args, world_size=8)
    assert (layout.cp_implementation, layout.dp_shard_size, layout.parallelism_config()) == (CP_ALL_TO_ALL, 8, None)


# ---- what a split leaves behind (issue 47) -----------------------------------------------------------------------


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def registered(name: str) -> tuple[bool, bool]:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return name in ALL_ATTENTION_FUNCTIONS, name in ALL_MASK_ATTENTION_FUNCTIONS


def test_a_dropped_runs_split_leaves_no_registry_entry_nor_process_group(one_process_group):
    """What a trainer holds (the arguments' layout, its split, its model), dropped as the trainer is and
    collected: the split's attention and mask entries and the layout's sequence group are gone."""
    import gc

    import torch.distributed as dist

    from optimum_gaudi.distributed.layout import CP_ALL_TO_ALL, ParallelLayout

    layout = ParallelLayout(world_size=1, cp_size=1, cp_implementation=CP_ALL_TO_ALL)
    split, model = layout.sequence_parallel(), tiny.llama()
    split.use(model)
    name, group = split.name, split.group
    assert registered(name) == (True, True) and dist.get_rank(group) == 0
    del layout, split, model
    gc.collect()
    assert registered(name) == (False, False)
    with pytest.raises(ValueError, match="not registered"):
        dist.get_rank(group)


def test_a_model_kept_after_its_split_still_runs_it_and_releases_it_when_collected():
    """The entry is the model's attention: it stays while the model lives (outside a split step it is the local
    kernel), and goes with the model."""
    import gc

    import torch

    from optimum_gaudi.distributed.sequence_parallel import SequenceParallel

    model, plain = tiny.llama(), tiny.llama()
    split = SequenceParallel(2, group=None, data_parallel_size=1, data_parallel_index=0)  # evaluation: no group
    split.use(model)
    name = split.name
    del split
    gc.collect()
    ids = torch.arange(1, 17).reshape(1, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=0)
    assert registered(name) == (True, True)
    del model
    gc.collect()
    assert registered(name) == (False, False)


def test_a_split_model_copies_and_pickles_and_a_trainer_without_a_split_takes_it_off(one_process_group):
    """The seam keeps the split's name, not the split and its process group: ``copy.deepcopy`` and ``torch.save`` of
    the model work, as they did when only the config named the split; a request laid under the split is wrapped by
    it; a preparation with no split of its own (another trainer on this model) takes it off."""
    import copy
    import io

    import torch

    from optimum_gaudi.distributed.layout import CP_ALL_TO_ALL, ParallelLayout
    from optimum_gaudi.features import attention
    from optimum_gaudi.seam import Seam

    layout = ParallelLayout(world_size=1, cp_size=1, cp_implementation=CP_ALL_TO_ALL)
    split, model = layout.sequence_parallel(), tiny.llama()
    split.use(model)
    copy.deepcopy(model)
    torch.save(model, io.BytesIO())
    attention.use(model, type("Args", (), {"attn_implementation": "eager"})(), device=None)
    seam = Seam.of(model, "attn_implementation")
    assert seam.stages == ("requested", "sequence_parallel") and split.base == "eager"
    assert model.config._attn_implementation == split.name
    seam.remove("sequence_parallel")
    assert model.config._attn_implementation == "eager"


def test_a_collected_layout_keeps_a_group_whose_destroy_waits_for_every_rank(one_process_group, monkeypatch):
    """hccl's destroy starts with a barrier with no deadline (the bridge's ProcessGroupHCCL.cpp, destroy ->
    hostBarrier): a rank collecting its layout alone would wait for the others forever, so such a group is left in
    torch's registry (here a gloo group of one, reported as hccl's)."""
    import gc

    import torch.distributed as dist

    from optimum_gaudi.distributed.layout import CP_ALL_TO_ALL, ParallelLayout

    layout = ParallelLayout(world_size=1, cp_size=1, cp_implementation=CP_ALL_TO_ALL)
    group = layout.sequence_parallel().group
    real = dist.get_backend
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "hccl" if g is group else real(g))
    del layout
    gc.collect()
    assert dist.get_rank(group) == 0  # still registered
