"""The census check (tests/census.py) against docs/collectives.md: a run whose collective the table lacks fails,
whoever issued it; the table's rows are all read. The runs that feed it are multi-process tests on the simulated
device (docs/collectives.md names them)."""

from __future__ import annotations

import json

import census
import pytest

NONFINITE = ["optimum_gaudi.supervision.nonfinite:_spike", "optimum_gaudi.supervision.nonfinite:_problem",
             "optimum_gaudi.trainers.trainer:_maybe_log_save_evaluate"]  # fmt: skip


def write_log(tmp_path, *collectives):
    """A simulator call log (``FAKE_HPU_CALL_LOG``) of one rank holding ``collectives``."""
    (tmp_path / "simulator.json.0").write_text(json.dumps({"collectives": [list(c) for c in collectives]}))
    return tmp_path / "simulator.json"


def test_the_non_finite_guards_collectives_are_named_and_documented(tmp_path):
    spike = ("allreduce", "SUM", ["float32"], "hpu", 2, NONFINITE)
    deepspeed = ("allreduce", "MAX", ["float32"], "hpu", 2, NONFINITE[1:])
    entries = census.check(write_log(tmp_path, spike, deepspeed), range(1))
    assert {census.key(e) for e in entries} == {("non-finite guard", "allreduce", "SUM", "float32"),
                                                ("non-finite guard", "allreduce", "MAX", "float32")}  # fmt: skip


def test_a_collective_the_table_lacks_fails_the_check_with_its_row(tmp_path):
    """A float64 spike all-reduce (a change of dtype) is a collective HCCL maps that the table does not hold."""
    undocumented = ("allreduce", "SUM", ["float64"], "hpu", 2, NONFINITE)
    with pytest.raises(AssertionError, match="add these rows") as failure:
        census.check(write_log(tmp_path, undocumented), range(1))
    row = "| non-finite guard | `allreduce` | SUM | float64 | `optimum_gaudi.supervision.nonfinite:_spike` |"
    assert row in str(failure.value)


def test_every_row_of_the_table_is_read():
    table = [line for line in census.DOC.read_text().splitlines() if line.startswith("| ") and "`" in line]
    assert len(census.documented()) == len(table) > 30
