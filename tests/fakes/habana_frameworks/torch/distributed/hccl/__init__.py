"""TEST DOUBLE of ``habana_frameworks.torch.distributed.hccl``.

Follows ``distributed/hccl/__init__.py``: importing it calls ``initialize_distributed_hpu()``, which

- unless RANK, WORLD_SIZE and LOCAL_RANK are all set, copies OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK
  into them when all three Open MPI variables are there;
- sets MASTER_ADDR=localhost and MASTER_PORT=12345 when they are missing;
- sets HLS_MODULE_ID (the card this process opens) from LOCAL_RANK when there are several processes,
  through HABANA_VISIBLE_MODULES when set, unless HLS_MODULE_ID is already set;
- sets ID to the rank;

then registers the 'hccl' torch.distributed backend. Without the simulated device 'hccl' is an alias of gloo
on CPU, so ``init_process_group(backend="hccl")`` works in a CPU test. With it (FAKE_HPU_DEVICE=1) 'hccl'
is a process group for device type hpu, as ``ProcessGroupHCCL.cpp``: its collectives take hpu tensors only
(the real one reads each tensor's device memory; a CPU tensor fails), each is a step boundary in lazy mode
(``StepMarker`` before the collective), and the data moves through gloo on host copies. It refuses what the bridge's
group refuses (``_maps.py``: reduce ops other than SUM / PRODUCT / MIN / MAX, dtypes outside its map) and reduces
other dtypes than bf16 / float32 on a float32 copy, as ``process_group_hccl_base.cpp`` does.

What the bridge's group does not give, the simulated one does not either (``ProcessGroupHCCL.cpp``,
``process_group_hccl_base.cpp``): it takes no timeout (``_create_process_group_hccl`` drops the options' one), a
``Work``'s ``wait(timeout)`` ignores its timeout, ``barrier`` is ``hostBarrier``, a store poll with no deadline,
torch's ``_get_sequence_number_for_group`` refuses it (a custom backend) and it writes nothing to torch's flight
recorder: ``_deadlines.py``.

Every collective is also kept in a census (``census``: collective, reduce op, dtypes, device, group size and the
Python modules that issued it), written with the call log (``FAKE_HPU_CALL_LOG``) for the census test.
"""

import atexit
import os
import sys

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d  # the options classes (torch.distributed's lack some before 2.8)

import habana_frameworks as _hf
from habana_frameworks import _device

from . import _deadlines, _maps

# (collective, reduce op or None, dtypes, device type, group size, issuing modules): each distinct one once
census: set[tuple] = set()
# frames that say nothing about who issued a collective: the simulator, torch's c10d front end, decorators, and
# optimum-gaudi's collective count (its stand-ins for torch's functions and its DDP hook, which replays the reducer)
_PLUMBING = ("habana_frameworks", "torch.distributed.distributed_c10d", "torch.distributed.c10d_logger",
             "torch.utils._contextlib", "contextlib", "functools", "torch.autograd", "torch._tensor",
             "torch._dynamo.eval_frame", "optimum_gaudi.supervision.collective_count")  # fmt: skip


def _issuers(limit: int = 40) -> tuple[str, ...]:
    """``module:function`` of the frames on the Python stack below the collective, innermost first (each once)."""
    found: list[str] = []
    frame = sys._getframe(1)
    while frame is not None and len(found) < limit:
        module = frame.f_globals.get("__name__", "?")
        where = f"{module}:{frame.f_code.co_name}"
        if not module.startswith(_PLUMBING) and where not in found:
            found.append(where)
        frame = frame.f_back
    return tuple(found)


_MPI_TO_TORCH = {
    "OMPI_COMM_WORLD_LOCAL_RANK": "LOCAL_RANK",
    "OMPI_COMM_WORLD_SIZE": "WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK": "RANK",
}


def _environment_from_mpi():
    if all(name in os.environ for name in _MPI_TO_TORCH.values()):
        return
    if all(name in os.environ for name in _MPI_TO_TORCH):
        for mpi_name, torch_name in _MPI_TO_TORCH.items():
            os.environ[torch_name] = os.environ[mpi_name]
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "12345")


def _module_id(local_rank, world_size):
    if "HLS_MODULE_ID" in os.environ or local_rank == -1 or world_size == 1:
        return
    visible = os.environ.get("HABANA_VISIBLE_MODULES")
    if visible is not None:
        modules = visible.split(",")
        assert local_rank < len(modules), "There is not enough devices available for training."
        os.environ["HLS_MODULE_ID"] = modules[local_rank]
    else:
        os.environ["HLS_MODULE_ID"] = str(local_rank)


def initialize_distributed_hpu(world_size=None, rank=None, local_rank=None):
    """Returns (world_size, rank, local_rank): the given values (then exported), else those of the environment."""
    _hf.record("distributed.hccl.initialize_distributed_hpu", world_size=world_size, rank=rank, local_rank=local_rank)
    if None not in (world_size, rank, local_rank):
        os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(local_rank))
    else:
        _environment_from_mpi()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", -1))
    local_rank = int(os.environ.get("LOCAL_RANK", -1))
    _module_id(local_rank, world_size)
    if rank != -1:
        os.environ["ID"] = str(rank)
    return world_size, rank, local_rank


initialize_distributed_hpu()


def _create_process_group_hccl(backend_opts, pg_opts):
    """``distributed/hccl/__init__.py``: the group is made from the store, rank, size and name only; the options'
    timeout is dropped (``ProcessGroupHCCL`` takes none). Off the device a gloo group that never times out."""
    return dist.ProcessGroupGloo(backend_opts.store, backend_opts.group_rank, backend_opts.group_size,
                                 _deadlines.NO_DEADLINE)  # fmt: skip


def _create_device_process_group_hccl(backend_opts, pg_opts):
    """As ``_create_process_group_hccl``, on the simulated device."""
    return _ProcessGroupHCCL(backend_opts.store, backend_opts.group_rank, backend_opts.group_size)


class _DoneWork(dist._Work):
    """A collective that has finished (the host copies are synchronous).

    The bridge's ``WorkHCCL`` is a C++ object, alive as long as torch's C++ holds it. This one is a Python subclass:
    torch 2.6's functional collectives (``_c10d_functional``, DTensor's ``full_tensor``) keep only its C++ part until
    ``wait_tensor``, and once the Python object is collected the base ``Work::wait`` runs, which waits forever for a
    completion nobody marks. So each work stays referenced here until it is waited on (the newest ``_KEPT`` of
    them: a work nobody waits on, as DDP's reducer reads only its future, is let go in time)."""

    _KEPT = 4096
    _alive: dict[int, "_DoneWork"] = {}

    def __init__(self, result):
        super().__init__()
        self._future = torch.futures.Future()
        self._future.set_result(result)
        alive = _DoneWork._alive
        alive[id(self)] = self
        if len(alive) > self._KEPT:
            del alive[next(iter(alive))]

    def wait(self, timeout=None):
        """``ProcessGroupHCCL.cpp`` ``WorkHCCL::wait``: the timeout is ignored ("abort API is not implemented")."""
        _DoneWork._alive.pop(id(self), None)
        return True

    def get_future(self):
        return self._future


class _ProcessGroupHCCL(dist.ProcessGroup):
    def __init__(self, store, rank, size):
        super().__init__(rank, size)
        self._store = store
        self._barriers = 0  # hostBarrier's counter (process_group_hccl_base.cpp)
        # the data moves through gloo, which never times out here: ProcessGroupHCCL has no timeout
        self._gloo = dist.ProcessGroupGloo(store, rank, size, _deadlines.NO_DEADLINE)

    def getBackendName(self):
        return "hccl"

    # The real group is a C++ backend under torch's ProcessGroup, registered for device type hpu: the group
    # answers the name torch gives it (``init_process_group``, ``new_group``; DeviceMesh and FSDP2 read it) and
    # its device types (object collectives, as torch.distributed.checkpoint's, then move their bytes on hpu). A
    # Python ProcessGroup has no backend to keep them in: answered here.
    def _set_group_name(self, name):
        self._group_name = name

    @property
    def group_name(self):
        return self._group_name

    @property
    def _device_types(self):
        return [torch.device("hpu")]

    def _enter(self, name, tensors, op=None):
        for tensor in tensors:
            if tensor.device.type != "hpu":
                raise RuntimeError(f"hccl {name}: tensors must be on the HPU, got one on {tensor.device}")
        op = None if op is None else _maps.op_name(op)
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
        census.add((name, op, tuple(dtypes), "hpu", self.size(), _issuers()))
        if name in _maps.DTYPE_CHECKED:  # getHCCLDataType (collective_utils.cpp)
            for tensor in tensors:
                _maps.check_dtype(tensor.dtype)
        if op is not None:  # getHCCLReduceOp, on the dtype the reduction runs in
            for tensor in tensors:
                _maps.check_reduce_op(op, _maps.reduction_dtype(name, tensor.dtype))
        _hf.record(f"distributed.hccl.{name}", shapes=[list(t.shape) for t in tensors], op=op, dtypes=dtypes)
        from habana_frameworks.torch.utils.internal import is_lazy

        if is_lazy():  # StepMarker before the collective (ProcessGroupHCCL::collective)
            _hf.record("distributed.hccl.step_marker", collective=name)

    def _run(self, name, tensors, call, outputs=None, op=None, reduce_in=None):
        """``call(host_in, host_out)`` on host copies, in the dtype the bridge reduces in (``reduce_in``)."""
        outputs = tensors if outputs is None else outputs
        self._enter(name, tensors if outputs is tensors else tensors + [t for t in outputs if t is not None], op)
        host_in = [t.cpu() if reduce_in is None else t.cpu().to(reduce_in(t.dtype)) for t in tensors]
        host_out = (
            host_in if outputs is tensors else [o.cpu().to(i.dtype) for o, i in zip(outputs, host_in, strict=True)]
        )
        call(host_in, host_out).wait()
        with torch.no_grad():
            for target, value in zip(outputs, host_out, strict=True):
                target.copy_(value)
        return _DoneWork(outputs)

    def allreduce(self, tensors, opts=None):
        opts = opts or _c10d.AllreduceOptions()
        reduce_in = lambda dtype: _maps.reduction_dtype("allreduce", dtype)  # noqa: E731
        return self._run(
            "allreduce",
            list(tensors),
            lambda i, o: self._gloo.allreduce(i, opts),
            op=opts.reduceOp,
            reduce_in=reduce_in,
        )

    def broadcast(self, tensors, opts=None):
        opts = opts or _c10d.BroadcastOptions()
        return self._run("broadcast", list(tensors), lambda i, o: self._gloo.broadcast(i, opts))

    def _into_lists(self, name, output_lists, inputs, call):
        """A collective whose outputs are lists of tensors (all-gather, gather), on host copies."""
        flat = [t for group in output_lists for t in group]
        self._enter(name, list(inputs) + flat)
        host_out = [[t.cpu() for t in group] for group in output_lists]
        call(host_out, [t.cpu() for t in inputs]).wait()
        with torch.no_grad():
            for group, values in zip(output_lists, host_out, strict=True):
                for target, value in zip(group, values, strict=True):
                    target.copy_(value)
        return _DoneWork(output_lists)

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or _c10d.AllgatherOptions()
        # process_group_hccl_base.cpp: outputs of one size are one hcclAllGather (dtype checked); others a broadcast
        # per rank (_broadcast_oop), which moves bytes
        even = len({t.numel() for group in output_lists for t in group}) <= 1
        name = "allgather" if even else "allgather_uneven"
        return self._into_lists(name, output_lists, inputs, lambda o, i: self._gloo.allgather(o, i, opts))

    def _allgather_base(self, output, input, opts=None):
        opts = opts or _c10d.AllgatherOptions()
        if input.dtype != output.dtype:  # process_group_hccl_base.cpp _allgather_base
            raise RuntimeError("output tensor must have the same type as input tensor")
        return self._run(
            "allgather_into_tensor", [input], lambda i, o: self._gloo._allgather_base(o[0], i[0], opts), [output]
        )

    all_gather_single = _allgather_base  # torch 2.13's name for all_gather_into_tensor

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        """``process_group_hccl_base.cpp``: one all-gather into a tensor per pair (functional collectives, as
        DTensor's ``full_tensor``, come this way)."""
        for output, input in zip(outputs, inputs, strict=True):
            self._allgather_base(output, input, opts)
        return _DoneWork(outputs)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        """``process_group_hccl_base.cpp``: one reduce-scatter into a tensor per pair."""
        for output, input in zip(outputs, inputs, strict=True):
            self._reduce_scatter_base(output, input, opts)
        return _DoneWork(outputs)

    def allreduce_coalesced(self, tensors, opts=None):
        """``process_group_hccl_base.cpp``: the all-reduce of the same tensors."""
        options = _c10d.AllreduceOptions()
        if opts is not None:
            options.reduceOp = opts.reduceOp
        return self.allreduce(tensors, options)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """``ProcessGroupHcclBase::alltoall_base`` (``process_group_hccl_base.cpp``): one tensor in, one out."""
        opts = opts or _c10d.AllToAllOptions()
        return self._run(
            "alltoall_base",
            [input],
            lambda i, o: self._gloo.alltoall_base(o[0], i[0], output_split_sizes, input_split_sizes, opts),
            [output],
        )

    def _reduce_scatter_base(self, output, input, opts=None):
        """reduce_scatter_tensor, as ``process_group_hccl_base.hpp`` declares it (FSDP's gradient reduction)."""
        opts = opts or _c10d.ReduceScatterOptions()
        if input.dtype != output.dtype:  # process_group_hccl_base.cpp _reduce_scatter_base
            raise RuntimeError("input tensor must be the same type as the output tensor.")
        if input.numel() != output.numel() * self.size():
            raise RuntimeError("input tensor must be the same size as output size times world size")
        reduce_in = lambda dtype: _maps.reduction_dtype("reduce_scatter_tensor", dtype)  # noqa: E731
        return self._run(
            "reduce_scatter_tensor",
            [input],
            lambda i, o: self._gloo._reduce_scatter_base(o[0], i[0], opts),
            [output],
            op=opts.reduceOp,
            reduce_in=reduce_in,
        )

    reduce_scatter_single = _reduce_scatter_base  # torch 2.13's name for reduce_scatter_tensor

    def gather(self, output_lists, inputs, opts=None):
        """As ``process_group_hccl_base.hpp``: the root receives a list (torch.distributed.checkpoint's plans)."""
        opts = opts or _c10d.GatherOptions()
        return self._into_lists("gather", output_lists, inputs, lambda o, i: self._gloo.gather(o, i, opts))

    def scatter(self, outputs, input_lists, opts=None):
        """As ``process_group_hccl_base.hpp``: the root sends each rank its part."""
        opts = opts or _c10d.ScatterOptions()
        flat = [t for group in input_lists for t in group]
        self._enter("scatter", list(outputs) + flat)
        host_out = [t.cpu() for t in outputs]
        self._gloo.scatter(host_out, [[t.cpu() for t in group] for group in input_lists], opts).wait()
        with torch.no_grad():
            for target, value in zip(outputs, host_out, strict=True):
                target.copy_(value)
        return _DoneWork(outputs)

    def barrier(self, opts=None):
        """``ProcessGroupHCCL.cpp`` ``barrier``: ``hostBarrier()``, a poll of the group's store with no deadline
        (the options' timeout is not read)."""
        _hf.record("distributed.hccl.barrier")
        self._barriers = _deadlines.host_barrier(self._store, self.rank(), self.size(), self._barriers)
        return _DoneWork([])


# What torch's C++ calls on the group (its ProcessGroup trampoline): on the bridge these are C++ (ProcessGroupHCCL.cpp,
# process_group_hccl_base.cpp), which dynamo never sees. Here they are Python frames, which a compiled region's frame
# hook would try to trace when a collective the region graph-broke on (DDP's buffer broadcast in the forward, an
# all-to-all in attention) calls back into them, and fail on the group as an opaque object. Each is marked for dynamo
# to leave alone, so a compiled model meets this group as it meets the C++ one.
_ENTRY_POINTS = ("getBackendName", "allreduce", "broadcast", "allgather", "_allgather_base", "all_gather_single",
                 "allgather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "allreduce_coalesced",
                 "alltoall_base", "_reduce_scatter_base", "reduce_scatter_single", "gather", "scatter", "barrier")  # fmt: skip
for _name in _ENTRY_POINTS:
    setattr(_ProcessGroupHCCL, _name, torch.compiler.disable(getattr(_ProcessGroupHCCL, _name)))


# distributed/hccl/__init__.py COLLECTIVE_BASE_NAMES: a torch.distributed function whose name holds one of these
_COLLECTIVE_NAMES = ("all_gather", "all_reduce", "all_to_all", "barrier", "broadcast", "gather", "irecv", "isend",
                     "recv", "reduce", "scatter", "send")  # fmt: skip


def _disallow_collectives_in_graph() -> None:
    """As the bridge's ``_disallow_collectives_in_graph`` at import (a work-around for pytorch issue 102478): every
    collective function of ``torch.distributed`` is disallowed in dynamo graphs, with torch's own helper. On torch
    2.13 dynamo first rewrites a traced ``dist.all_reduce`` (and the other traceable collectives) into its
    functional form (``_c10d_functional``), which the disallowed list does not hold: the collective enters the
    graph, on the real bridge as here. Taken back when the simulator unloads (in-process tests import it often)."""
    import inspect
    import warnings

    import torch._dynamo
    from torch._dynamo import trace_rules

    # the ids dynamo's helper takes a function out of (the nonstrict set came with torch 2.7)
    names = ("_allowed_callable_ids", "_nonstrict_trace_callable_ids")
    sets = tuple(getattr(trace_rules, name) for name in names if hasattr(trace_rules, name))
    changed = []
    for member in dir(dist):
        with warnings.catch_warnings():  # dist.reduce_op's deprecation warning: noise, not behaviour to model
            warnings.simplefilter("ignore")
            function = getattr(dist, member)
            is_function = inspect.isfunction(function)
        if is_function and any(name in function.__name__ for name in _COLLECTIVE_NAMES):
            before = [id(function) in ids for ids in (*sets, trace_rules._disallowed_callable_ids)]
            torch._dynamo.decorators._disallow_in_graph_helper(False)(function)
            changed.append((function, before))

    def undo() -> None:
        for function, (*were, disallowed) in changed:
            if not disallowed:
                trace_rules._disallowed_callable_ids.remove(id(function))
            for ids, was in zip(sets, were, strict=True):
                if was:
                    ids.add(id(function))

    _hf.on_unload(undo)


def _destroy_at_exit() -> None:
    """The group is a Python object holding a gloo group: destroyed during interpreter teardown, gloo's threads
    could abort a rank on its way out. An atexit hook (a simulator artifact; the real group is C++) destroys it
    while Python is still whole."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _register_backend(creator, devices: list[str]) -> None:
    """``dist.Backend.register_backend("hccl", ...)``, as the bridge does at import, taken back when the simulator
    unloads (a test double's hygiene: torch before 2.8 refuses a second registration of a name, "HCCL c10d
    backend already exist", and in-process tests import the simulator many times)."""
    backend = dist.Backend
    dist.Backend.register_backend("hccl", creator, devices=devices, extended_api=True)

    def undo() -> None:
        if hasattr(backend, "HCCL"):
            delattr(backend, "HCCL")
        backend._plugins.pop("HCCL", None)
        if "hccl" in backend.backend_list:
            backend.backend_list.remove("hccl")
        for table in (backend.backend_capability, backend.backend_type_map):
            table.pop("hccl", None)
        for device in [d for d, name in backend.default_device_backend_map.items() if name == "hccl"]:
            del backend.default_device_backend_map[device]

    _hf.on_unload(undo)


if dist.is_available():
    _disallow_collectives_in_graph()
if dist.is_available() and hasattr(dist, "ProcessGroupGloo") and _device.loaded():
    atexit.register(_destroy_at_exit)
    _hf.on_unload(_deadlines.keep_out_of_the_flight_recorder())
    _register_backend(_create_device_process_group_hccl, ["hpu"])
    _hf.record("distributed.hccl.register", backend="hccl", alias_of=None)
elif dist.is_available() and hasattr(dist, "ProcessGroupGloo"):
    _register_backend(_create_process_group_hccl, ["cpu"])
    _hf.record("distributed.hccl.register", backend="hccl", alias_of="gloo")
else:
    _hf.record("distributed.hccl.register", backend="hccl", alias_of=None)
