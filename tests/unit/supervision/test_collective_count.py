"""The project's own collective count (supervision/collective_count.py, issue 46 point 4): where the backend keeps
none (HCCL), collectives issued through torch.distributed's functions and DDP's reducer are counted per group with
the collective and its call site, and DDP's gradients keep their bits. The watchdog's use of it on simulated
Gaudis: tests/integration/supervision/test_stalled_slow_or_diverging_ranks.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from support import SCRIPTS, job_environment

from optimum_gaudi.launch.ranks import FLIGHT_RECORDER_ENV, NCCL_FLIGHT_RECORDER_ENV, enable_flight_recorder
from optimum_gaudi.supervision import collective_count

C10D = torch._C._distributed_c10d


def test_a_backend_with_sequence_numbers_and_a_flight_record_is_not_counted_again(tmp_path, monkeypatch):
    """On gloo torch numbers the collectives and, from torch 2.8 with its flight recorder on (the training
    arguments turn it on), the recorder names them: nothing is replaced. On torch 2.6 and 2.7, whose recorder holds
    NCCL's only, or with the recorder off, gloo's are counted for their names."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        original = dist.all_reduce
        assert collective_count.backend_counts()
        for recorder in ("2000", "0"):
            monkeypatch.setenv(FLIGHT_RECORDER_ENV, recorder)
            if recorder != "0" and collective_count.generic_flight_recorder():
                assert collective_count.start() is None
                assert dist.all_reduce is original and collective_count.active() is None
            else:
                assert collective_count.start() is not None and dist.all_reduce is not original
            collective_count.stop()
    finally:
        collective_count.stop()
        dist.destroy_process_group()


@pytest.fixture
def nccl_like(tmp_path, monkeypatch):
    """A gloo group of one read as NCCL's: its backend named "nccl", numbering its collectives as gloo does (as
    ProcessGroupNCCL's getSequenceNumberForGroup, torch's ProcessGroupNCCL.hpp), NCCL's own flight recorder a
    stand-in (this torch may be built without NCCL, which has no ``_dump_nccl_trace_json``); recorders off."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    monkeypatch.setattr(collective_count, "_default_backend", lambda: "nccl")
    record = {"json": b'{"entries": []}'}
    monkeypatch.setattr(C10D, "_dump_nccl_trace_json", lambda collectives, only_active: record["json"], raising=False)
    for name in (FLIGHT_RECORDER_ENV, NCCL_FLIGHT_RECORDER_ENV):
        monkeypatch.delenv(name, raising=False)
    try:
        yield record
    finally:
        while collective_count.active() is not None:
            collective_count.stop()
        dist.destroy_process_group()


def test_on_nccl_its_own_recorder_names_the_collectives_once_the_arguments_turn_it_on(nccl_like, monkeypatch):
    """NCCL records into a recorder of its own (``_dump_nccl_trace_json``; gloo's, ``_dump_fr_trace_json``, holds
    none of NCCL's: torch's ProcessGroupNCCL.cpp, FlightRecorder.cpp), sized by TORCH_NCCL_TRACE_BUFFER_SIZE alone
    on torch 2.6 and 2.7. With the recorder off the count runs for the names; with the variables the training
    arguments set (enable_flight_recorder, as GaudiTrainingArguments calls it) NCCL's record is read and nothing
    is replaced. A custom backend's collectives are in no recorder of torch's (HCCL: the count)."""
    original = dist.all_reduce
    assert collective_count.flight_record_dump() is None
    assert collective_count.start() is not None and dist.all_reduce is not original
    collective_count.stop()
    environ: dict[str, str] = {}
    enable_flight_recorder(environ, nccl_variable=not collective_count.generic_flight_recorder())
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert collective_count.flight_record_dump() is C10D._dump_nccl_trace_json
    assert collective_count.start() is None and dist.all_reduce is original
    assert collective_count.flight_record_dump(
        "hccl"
    ) is None and not collective_count.flight_recorder_names_collectives("hccl")
    gloo = collective_count.flight_record_dump("gloo")
    assert gloo is (C10D._dump_fr_trace_json if collective_count.generic_flight_recorder() else None)


def test_collectives_are_counted_per_group_with_their_call_site_and_an_object_collective_once(group_without_a_count):
    original = dist.all_reduce
    count = collective_count.start()
    assert count is not None and dist.all_reduce is not original
    assert dist.distributed_c10d.all_reduce is dist.all_reduce  # the callers through either module
    other = dist.new_group([0])
    dist.all_reduce(torch.ones(2))
    dist.broadcast(torch.ones(2), 0)
    line = sys._getframe().f_lineno + 1
    dist.all_gather_object([None], {"a": 1}, group=other)  # all_gather underneath: counted once
    assert count.default_count() == 2 and count.counts[collective_count.group_key(other)] == 1
    waiting = count.waiting_in()
    assert waiting.startswith(f"all_gather_object on group {other.group_name} (its collective 1, issued ")
    assert f"test_collective_count.py:{line} (test_collectives_are_counted" in waiting
    assert waiting.endswith("; optimum-gaudi's count)")
    work = dist.all_reduce(torch.ones(1), async_op=True)  # asynchronous: not known to have come back
    work.wait()
    assert count.waiting_in().startswith("all_reduce on the default group (its collective 3, ")
    collective_count.stop()
    assert dist.all_reduce is original and dist.distributed_c10d.all_reduce is original
    dist.all_reduce(torch.ones(1))
    assert count.default_count() == 3  # stopped: nothing counts


def test_the_counting_hook_gives_ddps_gradients_bit_for_bit_and_is_refused_where_it_could_not(tmp_path):
    """3 gloo processes (tests/scripts/ddp_hook_bits.py): for groups of 2 and 3, gradients in the buckets or not,
    zeroed to None or to zeros, each step's gradients with the hook equal those without, bit for bit, and the hook
    counts the bucket all-reduces. Refused where it cannot be exact (views, a size of 3): forced there, the bits
    differ from step 2 (the reducer divides the bucket views; the hook multiplies by 1/3)."""
    out = tmp_path / "bits.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "ddp_hook_bits.py"), str(out)],
        env=job_environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    forced = results.pop("size=3 view=True to_none=False hook=forced")
    assert forced["equal"] == [True, False, False]  # why it is refused there
    refused = {key for key, r in results.items() if not r["installed"]}
    assert refused == {"size=3 view=True to_none=True hook=asked", "size=3 view=True to_none=False hook=asked"}
    for key, result in results.items():
        assert result["equal"] == [True, True, True], key
        assert (result["counted"] > 0) == result["installed"], key


def test_the_hook_is_exact_where_the_reducers_two_scalings_agree():
    assert collective_count.ddp_hook_is_exact(False, 3)
    assert collective_count.ddp_hook_is_exact(True, 8) and collective_count.ddp_hook_is_exact(True, 64)
    assert not collective_count.ddp_hook_is_exact(True, 24)


def test_a_compiled_function_calling_a_collective_compiles_into_the_same_graph_with_the_count_on(group_without_a_count):
    """Dynamo rewrites torch's collective into a functional one: the counting function steps aside while it
    traces, so the graph (one, no break) is the one without the count, and nothing inside it is counted."""

    def step(x):
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    torch._dynamo.reset()
    without = torch._dynamo.explain(step)(torch.ones(4))
    torch._dynamo.reset()
    count = collective_count.start()
    counted = torch._dynamo.explain(step)(torch.ones(4))
    assert (
        (without.graph_count, without.graph_break_count) == (counted.graph_count, counted.graph_break_count) == (1, 0)
    )
    assert torch.equal(torch.compile(step)(torch.ones(4)), torch.full((4,), 3.0)) and count.counts == {}
    torch._dynamo.reset()


def hooked(model) -> bool:
    return any(hook is collective_count._count_and_reduce for hook, _ in model._comm_hooks)


def test_a_second_trainer_shares_the_running_count_hooks_its_own_ddp_module_and_does_not_end_the_firsts(
    group_without_a_count,
):
    """Two trainers in one process, the second's train() inside the first's (or transformers' loop begun again by
    --auto_find_batch_size): the second DDP module is hooked too, and its stop leaves the first's count running.
    Before, a start while a count ran returned it without hooking the module, and the first stop ended both."""
    original = dist.all_reduce
    first, second = (torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2)) for _ in range(2))
    count = collective_count.start(first)
    assert collective_count.start(second) is count and hooked(first) and hooked(second)
    collective_count.stop()  # the second trainer's train() ends
    assert collective_count.active() is count and dist.all_reduce is not original
    before = count.default_count()
    first(torch.ones(3, 4)).sum().backward()  # the first trainer's step: its bucket all-reduce still counted
    assert count.default_count() == before + 1 and count.last["default"].site.startswith("DDP's reducer")
    collective_count.stop()
    assert collective_count.active() is None and dist.all_reduce is original
    collective_count.stop()  # one stop too many (a trainer whose start counted nothing) changes nothing
    assert collective_count.start() is not count and collective_count.active().counts == {}  # a fresh count
