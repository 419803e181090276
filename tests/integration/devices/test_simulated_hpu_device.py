"""The simulated ``hpu`` device (tests/fakes, a test double: ``habana_frameworks/_device.py`` and
``torch/lib/fake_hpu_device.cpp``), checked in a fresh process as the examples run on it: tensors live on
``hpu``, one per process (``HPUDevice.cpp``, ``HPUGuardImpl.h``, ``hpu/__init__.py``), torch.autocast('hpu') follows
the bridge's op lists (``hpu_ops/autocast_helpers.h``), random ops draw from the HPU generator (``hpu/random.py``),
'hccl' takes hpu tensors only (``ProcessGroupHCCL.cpp``) and its group functions are the bridge's
(``core/torch_overwrites.py``),
torch.hpu's memory API counts the device's bytes (``hpu/memory.py``), and kernels write contiguous outputs
(torch's own fake tensors assume it for hpu: ``torch/_subclasses/fake_impls.py``)."""

import json
import os
import subprocess
import sys
import textwrap

from conftest import SIMULATED_PATH
from support import free_port

CHECKS = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    from transformers.utils import is_torch_hpu_available

    assert is_torch_hpu_available()

    # one device per process: this process opened module 1 of a machine of 2 Gaudis (HLS_MODULE_ID=1), which torch
    # sees as hpu:0 (HPUDevice.cpp); set_device only remaps an index to that module (hpu/__init__.py)
    assert torch.hpu.device_count() == 2 and torch.hpu.current_device() == 0
    for index in (1, 0, "hpu:1"):
        torch.hpu.set_device(index)
        assert torch.hpu.current_device() == 0 and os.environ["HLS_MODULE_ID"] == "1", index
    assert torch.empty(2, device="hpu:1").device == torch.ones(2).to("hpu:1").device == torch.device("hpu:0")
    assert torch.accelerator.current_device_index() == 0
    with torch.hpu.device(1):                                         # the process's own module
        pass
    def refused(call, error, text):
        try:
            call()
        except error as caught:
            assert text in str(caught), caught
        else:
            raise AssertionError(f"the bridge refuses it: {text}")
    refused(lambda: torch.hpu.device(2), AssertionError, "Requested device_id=2 is different from env_device_id=1")
    def exchange():                                                   # HPUGuardImpl.h exchangeDevice
        with torch.accelerator.device_index(1):
            pass
    refused(exchange, RuntimeError, "habana active device: 1 != 0")
    # hpu/random.py: the generator of device 0 only, even where index 1 is the process's own module
    refused(lambda: torch.hpu.get_rng_state(1), RuntimeError, "hpu get_rng_state supports only device 0")
    refused(lambda: torch.hpu.get_rng_state("hpu:1"), RuntimeError, "hpu get_rng_state supports only device 0")
    refused(lambda: torch.hpu.set_rng_state(torch.hpu.get_rng_state(), torch.device("hpu", 1)), RuntimeError,
            "hpu set_rng_state supports only device 0")
    refused(lambda: torch.hpu.get_rng_state("cpu"), ValueError, "Expected a hpu device, but got: cpu")
    assert torch.equal(torch.hpu.get_rng_state(torch.device("hpu")), torch.hpu.get_rng_state(0))
    # core/torch_overwrites.py: torch.manual_seed seeds the HPU's generator too; fork_rng forks hpu's by default, every
    # index below device_count() (2 here), and device 1's state is refused
    torch.manual_seed(3)
    drawn = torch.rand(4, device="hpu").cpu()
    torch.manual_seed(3)
    assert torch.equal(torch.rand(4, device="hpu").cpu(), drawn)
    refused(lambda: torch.random.fork_rng().__enter__(), RuntimeError, "hpu get_rng_state supports only device 0")
    state = torch.hpu.get_rng_state()
    with torch.random.fork_rng(devices=[0]):                           # the hpu generator's state put back
        torch.rand(4, device="hpu")
    assert torch.equal(torch.hpu.get_rng_state(), state)

    # placement: a training step on hpu computes what the same step computes on the CPU
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    hpu_model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    hpu_model.load_state_dict(cpu_model.state_dict())
    hpu_model.to("hpu")
    assert all(p.device.type == "hpu" for p in hpu_model.parameters())
    x = torch.randn(4, 8)
    losses = []
    for model, data in ((cpu_model, x), (hpu_model, x.to("hpu"))):
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        for _ in range(3):
            loss = model(data).pow(2).mean()
            loss.backward()
            grad_device = model[0].weight.grad.device.type
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    assert losses[0] == losses[1] and grad_device == "hpu", (losses, grad_device)

    # autocast: lower list in bf16, fp32 list in fp32, the promote list in the widest input type, others as they are
    a = torch.randn(4, 4, device="hpu")
    with torch.autocast("hpu", dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16                         # matmul -> mm: default lower list
        assert torch.log(a.abs().bfloat16()).dtype == torch.float32    # default fp32 list
        two = torch.tensor(2.0, device="hpu")                          # 0-dim: plain promotion keeps bf16
        assert (a.bfloat16() + two).dtype == torch.float32              # the promote list: widest input
        assert (a.bfloat16() - two).dtype == torch.float32
        assert a.bfloat16().relu().dtype == torch.bfloat16             # no list: unchanged
        out = torch.empty(4, 4, device="hpu")
        torch.mm(a, a, out=out)                                        # out= keeps its own dtype, written
        assert out.dtype == torch.float32 and torch.allclose(out.cpu(), (a.cpu() @ a.cpu()), atol=1e-5)
        assert torch.hpu.is_autocast_hpu_enabled()
    assert (a @ a).dtype == torch.float32                              # outside the context
    assert (a.bfloat16() + torch.tensor(2.0, device="hpu")).dtype == torch.bfloat16

    # kernels: the CPU kernel where torch has one (not its composite decomposition), outputs contiguous
    x = torch.randn(2, 3, 8, device="hpu")
    with torch.autocast("hpu", dtype=torch.bfloat16):
        norm = torch.nn.functional.layer_norm(x, (8,), torch.ones(8, device="hpu"), torch.zeros(8, device="hpu"))
    assert norm.dtype == torch.bfloat16                                # first input cast, native layer norm
    assert x.transpose(1, 2).exp().is_contiguous() and torch.empty_like(x.transpose(1, 2)).is_contiguous()

    # random: hpu ops draw from the HPU generator, reseeded by torch.hpu.manual_seed, and leave the CPU's alone
    cpu_state = torch.get_rng_state()
    torch.hpu.manual_seed(7)
    first = torch.nn.functional.dropout(torch.ones(64, device="hpu"), 0.5)
    torch.hpu.manual_seed(7)
    again = torch.nn.functional.dropout(torch.ones(64, device="hpu"), 0.5)
    assert torch.equal(first.cpu(), again.cpu()) and torch.equal(torch.get_rng_state(), cpu_state)
    state = torch.hpu.get_rng_state()
    one = torch.rand(3, device="hpu")
    torch.hpu.set_rng_state(state)
    assert torch.equal(one.cpu(), torch.rand(3, device="hpu").cpu())

    # memory: the device's live bytes, kernel outputs included
    before = torch.hpu.memory_allocated()
    block = torch.empty(1 << 20, dtype=torch.uint8, device="hpu")
    assert torch.hpu.memory_allocated() - before >= 1 << 20 and torch.hpu.max_memory_allocated() >= before + (1 << 20)
    doubled = block * 2                                                # a CPU kernel's output, held by the device
    assert torch.hpu.memory_allocated() - before >= 2 << 20
    del block, doubled
    assert torch.hpu.memory_allocated() == before

    # set_ and views keep the storage
    t = torch.empty(0, device="hpu").set_(torch.arange(6.0, device="hpu").untyped_storage())
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]

    # core/torch_overwrites.py: the bridge's init_process_group and new_group take their first parameters only
    refused(lambda: dist.init_process_group(backend="hccl", device_id=torch.device("hpu")), TypeError, "device_id")
    import habana_frameworks as hf

    # with the comm group cache on (PT_ENABLE_COMM_GROUP_CACHE's default), init_process_group returns nothing
    assert dist.init_process_group("hccl", rank=0, world_size=1, init_method="tcp://127.0.0.1:29531") is None
    refused(lambda: dist.new_group([0], group_desc="tp"), TypeError, "group_desc")
    # 1.19.0's cache is emptied at each call: a group of the same ranks is a new group, with torch's 30 minutes
    first, second = dist.new_group([0]), dist.new_group(backend="hccl")
    assert first is not second and first.group_name != second.group_name
    made = hf.calls_named("core.new_group")
    assert [(c.kwargs["ranks"], c.kwargs["timeout"], c.kwargs["cached"]) for c in made] == [([0], 1800.0, False)] * 2

    # hccl: hpu tensors only

    t = torch.ones(3, device="hpu")
    dist.all_reduce(t)
    assert t.device.type == "hpu" and t.sum().item() == 3 and "distributed.hccl.allreduce" in hf.names()
    try:
        dist.all_reduce(torch.ones(3))
    except RuntimeError as error:
        assert "tensors must be on the HPU" in str(error), error
    else:
        raise AssertionError("hccl took a CPU tensor")

    # hccl's maps (backend/helpers/collective_utils.cpp): reduce ops SUM / PRODUCT / MIN / MAX, dtypes of its map
    for op in (dist.ReduceOp.AVG, dist.ReduceOp.BAND, dist._make_nccl_premul_sum(0.5)):
        for collective in (lambda t: dist.all_reduce(t, op=op),
                           lambda t: dist.reduce_scatter_tensor(torch.empty(2, device="hpu"), t, op=op)):
            try:
                collective(torch.ones(2, device="hpu"))
            except RuntimeError as error:
                assert "Unsupported ReduceOp for HCCL process group" in str(error), error
            else:
                raise AssertionError(f"hccl took {op}")
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int16, device="hpu"))
    except RuntimeError as error:
        assert "Input tensor data type is not supported for HCCL process group: int16" in str(error), error
    else:
        raise AssertionError("hccl took int16")
    big = torch.tensor([2**24 + 1], device="hpu")                      # int64: summed on a float32 copy
    dist.all_reduce(big)
    assert big.dtype == torch.int64 and big.item() == 2**24, big
    flags = torch.tensor([True, False], device="hpu")
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    assert flags.tolist() == [True, False]
    dist.destroy_process_group()

    # eager mode: a storage resized on the device (FSDP2 frees and regrows its gathered parameters so)
    t = torch.ones(4, device="hpu")
    t.untyped_storage().resize_(0)
    t.untyped_storage().resize_(16)
    assert t.untyped_storage().nbytes() == 16
    print("device checks passed")
    """
)


def test_the_simulated_device_behaves_as_the_bridge_documents(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_HPU", "FAKE_HPU", "RANK", "WORLD_SIZE"))}
    env.update(PYTHONPATH=SIMULATED_PATH, FAKE_HPU_DEVICE="1", FAKE_HPU_SOFTWARE="1.21", OMP_NUM_THREADS="1")
    env.update(FAKE_HPU_DEVICE_COUNT="2", HLS_MODULE_ID="1")  # the second card's process of a 2-card machine
    result = subprocess.run([sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "device checks passed" in result.stdout


LAZY_RESIZE = """
import torch, habana_frameworks.torch
t = torch.ones(4, device="hpu")
t.untyped_storage().resize_(0)
print("lazy kernels took set_")
"""


def test_lazy_kernels_abort_on_set_as_the_bridge_does():
    """``habana_kernels/lazy_kernels.cpp``: ``set_.source_Storage`` is HABANA_ASSERT(false) then std::terminate in lazy
    mode, and torch's ``UntypedStorage.resize_`` on a device storage runs it: the process aborts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_HPU", "FAKE_HPU", "RANK", "WORLD_SIZE"))}
    env.update(PYTHONPATH=SIMULATED_PATH, FAKE_HPU_DEVICE="1", FAKE_HPU_SOFTWARE="1.19", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", LAZY_RESIZE], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == -6 and "lazy kernels took" not in result.stdout, (result.returncode, result.stdout)
    assert "set_.source_Storage: This function should not be called in lazy flow" in result.stderr


AS_A_CPU_BUILD = """
import torch
from torch.utils.data import DataLoader

# a Gaudi's torch is a CPU build: HPU is the one accelerator torch finds, whatever this torch was built for
assert torch.accelerator.current_accelerator().type == "hpu" and torch.accelerator.is_available()
assert DataLoader([1, 2], pin_memory=True).pin_memory  # torch.accelerator, not a refusal
x = torch.ones(3, device="hpu", requires_grad=True)
(x * 2).sum().backward()  # the autograd engine asks the accelerator for its streams
assert x.grad.device.type == "hpu"
print("a cpu build's accelerator", torch.version.cuda)
"""


def test_the_accelerator_is_the_hpu_as_on_a_cpu_build_of_torch():
    """PyPI's Linux torch builds (2.6-2.10, the torch each Gaudi release ships) are CUDA builds, where torch's
    accelerator query found HPU and CUDA both built and refused ("Cannot have both HPU and cuda."): the DataLoader
    and the autograd engine failed before step 1. The simulated plugin stands where a Gaudi's CPU build would."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_HPU", "FAKE_HPU", "RANK", "WORLD_SIZE"))}
    env.update(PYTHONPATH=SIMULATED_PATH, FAKE_HPU_DEVICE="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", AS_A_CPU_BUILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "a cpu build's accelerator" in result.stdout


NO_DEADLINES = textwrap.dedent(
    """
    import datetime, json, os, sys, time, torch, torch.distributed as dist
    import habana_frameworks.torch.distributed.hccl  # noqa: F401

    late, rank = float(sys.argv[1]), int(os.environ["RANK"])
    dist.init_process_group("hccl", timeout=datetime.timedelta(seconds=1))
    host = dist.new_group(backend="gloo")                    # gloo beside it: its timeout and flight record hold
    dist.all_reduce(torch.ones(1), group=host)
    waited = {}
    for what in ("all_reduce", "barrier"):
        if rank == 1:
            time.sleep(late)                                 # joins long after the group's timeout
        started = time.monotonic()
        if what == "barrier":
            dist.barrier()
        else:
            work = dist.all_reduce(torch.ones(1, device="hpu"), async_op=True)
            assert work.wait(datetime.timedelta(milliseconds=1)) is True
        waited[what] = time.monotonic() - started
    try:
        dist.group.WORLD._get_sequence_number_for_group()
        sequence = "counted"
    except RuntimeError as error:
        sequence = str(error)
    dump = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, True))
    names = sorted({(e["profiling_name"], tuple(e["process_group"])) for e in dump["entries"]})
    print("RESULT", json.dumps({"waited": waited, "sequence": sequence, "recorded": names}))
    dist.destroy_process_group()
    """
)


def test_simulated_hccl_has_no_timeout_no_collective_count_and_no_flight_record(tmp_path):
    """As the bridge's group (``distributed/hccl/__init__.py``, ``ProcessGroupHCCL.cpp``,
    ``process_group_hccl_base.cpp``): a collective or barrier a rank joins 4 s after the group's 1 s timeout still
    completes (the timeout is dropped, ``wait`` ignores one, ``barrier`` polls the store), torch has no sequence
    number for it, and torch's flight recorder holds only the gloo group's collective."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_HPU", "FAKE_HPU", "RANK", "WORLD_SIZE"))}
    env.update(PYTHONPATH=SIMULATED_PATH, FAKE_HPU_DEVICE="1", FAKE_HPU_SOFTWARE="1.21", OMP_NUM_THREADS="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", FAKE_HPU_DEVICE_COUNT="2")
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", NO_DEADLINES, "4"],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [rank.communicate(timeout=240) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], [err[-3000:] for _, err in outputs]
    result = json.loads(next(line for line in outputs[0][0].splitlines() if line.startswith("RESULT"))[7:])
    assert result["waited"]["all_reduce"] > 3.5 and result["waited"]["barrier"] > 3.5, result
    assert result["sequence"] == "ProcessGroup hccl does not yet support sequence numbers.", result
    assert [name for name, _ in result["recorded"]] == ["gloo:all_reduce"], result
