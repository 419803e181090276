"""Each fix of issues 20, 37, 38, 39, 45 and 46 matters: its test fails without it. For each fix the script undoes it with a
small edit of the package, runs the test written for it (in a pytest process on the simulated hpu device where the
test is of the HPU path), expects a failure, and puts the file back.

    python tests/scripts/without_the_fixes.py [LABEL ...]     # on a clean work tree; about three minutes

The edits are made in the work tree itself: several of the tests start Python processes, which import this
checkout's package (tests/conftest.py puts it first on their PYTHONPATH), not a copy. Each file is written back
when its run ends; a run killed in between leaves its edit, which `git checkout -- optimum_gaudi setup.py` takes
back.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
I20 = "unit/devices/test_hpu_graphs_launch_and_op_names.py"
I20_LAUNCHED = "integration/devices/test_hpu_launch_and_lazy_mode.py"
STATIC = "integration/features/test_static_batch.py"
LAUNCH, LAUNCH_JOBS = "unit/launch/test_launch_settings.py", "integration/launch/test_launch_jobs.py"
FSDP = "integration/distributed/test_fsdp_trainings.py"
COMMANDS = "integration/optimum_habana/test_optimum_habana_commands.py"
USER_SETTINGS = "unit/devices/test_hpu_user_settings.py"
STALLS = "unit/supervision/test_watchdog_and_sigterm_agreement.py"
COUNT = "unit/supervision/test_collective_count.py"
WATCH = "unit/supervision/test_watch.py"


@dataclass(frozen=True)
class Undo:
    label: str
    point: str  # the point
    edits: tuple[tuple[str, str, str], ...]  # (file, text of the fix, text without it)
    tests: tuple[str, ...]
    device: bool = True  # run in a pytest process on the simulated hpu device


UNDOS = (
    # issue 45: torch 2.6 and 2.7 have no fp8 matmul on CPU; the test tells the seam so on any torch
    Undo("fp8-emulated", "45.2", (("optimum_gaudi/devices/base.py", "emulate=not has_fp8_matmul(self.type)",
                                   "emulate=False"),),
         ("integration/precision/test_fp8.py::test_fp8_on_a_torch_without_an_fp8_matmul_for_the_cpu_trains_emulated",),
         device=False),
    Undo("private-inputs", "1", (("optimum_gaudi/devices/hpu.py", "args, kwargs = private_inputs((args, kwargs))", "pass"),),
         (f"{I20}::test_evaluation_metrics_with_inference_graphs_equal_those_without",
          f"{I20}::test_seq2seq_labels_with_inference_graphs_equal_those_without")),
    Undo("graphs-bf16", "2", (("optimum_gaudi/devices/hpu.py", "training_graph_forward_bound_elsewhere = True",
                               "training_graph_forward_bound_elsewhere = False"),),
         (f"{I20}::test_bf16_with_training_graphs_trains_under_hpu_autocast",
          f"{I20}::test_bf16_with_training_graphs_and_fast_ddp_runs_the_graph_under_hpu_autocast")),
    Undo("launch-lazy", "3", (("optimum_gaudi/launch/environment.py", "    exported = environ.get(LAZY_MODE_ENV)\n",
                               '    exported = None\n    env[LAZY_MODE_ENV] = "1" if lazy else "0"\n'),),
         (f"{I20}::test_launch_environment_leaves_lazy_mode_to_the_user",
          f"{I20}::test_launch_refuses_an_exported_lazy_mode_the_arguments_contradict",
          f"{I20_LAUNCHED}::test_launch_lets_the_script_set_lazy_mode_in_code_on_gaudi_software_1_19")),
    Undo("deepspeed-env", "4", (("optimum_gaudi/launch/launcher.py",
                                 "env.update(deepspeed_env_file(plan, env, private))", "pass"),),
         (f"{LAUNCH}::test_deepspeed_over_ssh_gets_the_bridge_environment_through_a_private_env_file",), device=False),
    Undo("accelerate-1.5", "5", (("setup.py", '"accelerate>=1.5"', '"accelerate>=1.2"'),),
         (f"{I20}::test_setup_requires_the_accelerate_release_transformers_needs_for_a_gaudi",)),
    Undo("broken-bridge", "6", (("optimum_gaudi/devices/hpu.py", "        _hide_broken_bridge()\n        return False",
                                 "        return False"),),
         ("integration/devices/test_bridge_that_cannot_load.py",), device=False),  # a bridge that cannot load: no device
    Undo("masked-padding", "7", (("optimum_gaudi/features/static_batches.py",
                                  "        return padded if self.masked else None", "        return None"),),
         (f"{STATIC}::test_a_masked_short_batch_runs_the_full_batches_graph",)),
    Undo("rows-interact", "8", (("optimum_gaudi/features/static_batches.py",
                                 "            problem = self._rows_interact(run, inner, rows, size, args, kwargs)",
                                 "            problem = None"),
                                ("optimum_gaudi/features/static_batches.py",
                                 "            and all(a.shape == b.shape and _agree(a, b) for a, b in zip(cut, alone, strict=True))\n",
                                 "")),
         (f"{STATIC}::test_models_whose_rows_interact_are_not_padded",)),
    Undo("hpu-rng", "8", (("optimum_gaudi/devices/hpu.py", "            hpu_random.set_rng_state(state)", "            pass"),),
         (f"{STATIC}::test_the_check_leaves_the_gaudis_generator_as_it_found_it",)),
    Undo("op-names", "9", (("optimum_gaudi/precision/op_lists.py",
                            '    list_ops = getattr(torch._C, "_dispatch_get_all_op_names", None)',
                            "    list_ops = lambda: ['aten::renorm']  # a fixed vocabulary without rms_norm"),),
         (f"{I20}::test_op_names_of_the_running_torch_are_accepted_and_a_typo_is_not",)),
    Undo("decoder-left-pad", "10", (("optimum_gaudi/trainers/seq2seq.py", 'side = "right" if encoder_decoder else "left"',
                                     'side = "right"'),),
         ("unit/trainers/test_seq2seq.py::test_static_generation_of_a_decoder_only_model_pads_the_prompt_on_the_left",)),
    Undo("decoding-bypass", "10", (("optimum_gaudi/devices/hpu.py", "            if not replayable((args, kwargs)):",
                                    "            if False:"),),
         (f"{I20}::test_decoding_under_an_inference_graph_scores_as_without_it",)),  # T5's steps; Llama's replay right
    Undo("mpirun-per-node", "11", (("optimum_gaudi/launch/plan.py",
                                    "name.startswith(_MPI_FORWARDED_PREFIXES) and name not in _PER_NODE]",
                                    "name.startswith(_MPI_FORWARDED_PREFIXES)]"),),
         (f"{LAUNCH}::test_mpirun_forwards_the_bridge_variables_to_the_other_nodes",), device=False),
    Undo("mpirun-prefixes", "11", (("optimum_gaudi/launch/plan.py",
                                    '"PT_HPU_", "HABANA_", "HCCL_", "FI_", "HF_", "OPTIMUM_GAUDI_", '
                                    '"TORCH_DEVICE_BACKEND_AUTOLOAD", "PYTHONPATH",',
                                    '"PT_HPU_", "HABANA_", "HCCL_", "OPTIMUM_GAUDI_", "PYTHONPATH",'),),
         (f"{LAUNCH}::test_mpirun_forwards_the_bridge_variables_to_the_other_nodes",), device=False),
    Undo("group-rank", "11", (("optimum_gaudi/launch/plan.py",
                               '    e["GROUP_RANK"] = str(int(e["RANK"]) // int(e["LOCAL_WORLD_SIZE"]))',
                               '    e["GROUP_RANK"] = e["OMPI_COMM_WORLD_NODE_RANK"]'),),
         (f"{LAUNCH_JOBS}::test_mpi_worker_gives_each_rank_the_torch_variables",), device=False),
    Undo("ddp-second-train", "11", (("optimum_gaudi/preparation/pipeline.py",
                                     "        for candidate in (model, self.trainer.accelerator.unwrap_model(model, "
                                     "keep_torch_compile=False)):",
                                     "        for candidate in (model,):"),),
         (f"{I20}::test_a_second_train_under_ddp_takes_the_inference_graph_off_the_model",)),
    Undo("seam-order", "39", (("optimum_gaudi/seam.py",
                               "        peeled = self._peel(stage)\n", "        peeled = []\n"),),
         ("unit/test_seam.py::test_a_contribution_goes_under_the_ones_that_belong_over_it",),
         device=False),
    Undo("seam-own-loss", "39", (("optimum_gaudi/seam.py",
                                  "        if self.name in _OWN_WHEN_OVERWRITTEN and self._layers and self._overwritten():",
                                  "        if False:"),),
         ("unit/test_seam.py::test_a_loss_function_assigned_over_the_seam_is_the_models_own",),
         device=False),
    Undo("adamw-state", "11", (("optimum_gaudi/trainers/trainer.py", "        if made_here:\n", "        if False:\n"),),
         (f"{I20}::test_a_fused_adamw_checkpoint_resumes_on_torch_adamw_with_its_step_count_and_back",)),
    Undo("exported-dynamic-shapes", "11", (("optimum_gaudi/devices/hpu.py",
                                            "        if exported is not None and exported != os.environ.get("
                                            "DYNAMIC_SHAPES_OURS_ENV):",
                                            "        if False:"),),
         (f"{USER_SETTINGS}::test_an_exported_dynamic_shapes_variable_is_not_overridden_by_the_config",)),
    Undo("compile-mode", "11", (("optimum_gaudi/devices/hpu.py",
                                 "        if args.torch_compile_mode is not None and args.torch_compile_backend in "
                                 "(None, self.compile_backend):",
                                 "        if False:"),),
         (f"{USER_SETTINGS}::test_a_compile_mode_hpu_backend_ignores_is_said",)),
    Undo("op-list-dir-owner", "11", (("optimum_gaudi/precision/op_lists.py",
                                      "    if path.is_symlink() or info.st_uid != os.getuid() or info.st_mode & 0o022:",
                                      "    if False:"),),
         ("unit/configuration/test_configuration.py::test_op_list_files_live_in_a_directory_only_this_user_can_write",), device=False),
    Undo("op-list-by-content", "11", (("optimum_gaudi/precision/op_lists.py", "    if current != text:",
                                       "    if current is None:"),),
         ("unit/configuration/test_configuration.py::test_op_list_files_live_in_a_directory_only_this_user_can_write",), device=False),
    Undo("unused-parameters", "11", (("optimum_gaudi/trainers/step.py", "            parameter.grad = None  # as eager",
                                      "            pass  # as eager"),),
         (f"{I20}::test_a_parameter_the_forward_does_not_use_is_not_decayed_under_training_graphs",)),
    Undo("tensor-cache-said", "simulator", (("optimum_gaudi/devices/hpu.py",
                                             '        if exported is not None and (exported == "1") != disable_tensor_cache:',
                                             "        if False:"),),
         (f"{I20}::test_an_exported_tensor_cache_setting_wins_over_the_argument_and_is_said",)),
    Undo("dynamic-shapes-backward", "simulator", (("optimum_gaudi/trainers/training_args.py",
                                                   "problem = prepare_bridge(self.use_lazy_mode, op_lists, dynamic_shapes)",
                                                   "problem = prepare_bridge(self.use_lazy_mode, op_lists, None)"),),
         (f"{I20}::test_dynamic_shapes_reach_the_backwards_thread_in_lazy_mode",)),
    # issue 37: the strict simulator's hccl refuses AVG, its lazy kernels abort on set_ (each test launches its own
    # processes on the simulated device)
    Undo("fsdp-sum-reductions", "37.2", (("optimum_gaudi/trainers/step.py",
                                          "            self.gradient_divisor = reduce_with_sum(model)",
                                          "            self.gradient_divisor = 1"),),
         (f"{FSDP}::test_fsdp_on_two_simulated_gaudis_saves_sharded_checkpoints_and_resumes",), device=False),
    Undo("fsdp-lazy-refused", "37.2", (("optimum_gaudi/trainers/configuration_problems.py",
                                        "    if args.fsdp and args.use_lazy_mode:", "    if False:"),),
         (f"{FSDP}::test_lazy_mode_with_fsdp_on_a_simulated_gaudi_stops_at_the_arguments",), device=False),
    Undo("fp8-state-per-rank", "37.2", (("optimum_gaudi/precision/plan.py",
                                         "        if self.fp8 is not None:  # every rank its own amax history",
                                         "        if self.fp8 is not None and self._ranks()[0] == 0:  # rank 0 only"),),
         (f"{FSDP}::test_fp8_scaling_state_is_each_ranks_own_and_resumed_exactly_on_two_simulated_gaudis",),
         device=False),
    Undo("fp8-state-bytesio", "37.2", (("optimum_gaudi/precision/fp8.py", "isinstance(value, (torch.Tensor, io.BytesIO))",
                                        "isinstance(value, torch.Tensor)"),),
         (f"{FSDP}::test_fp8_scaling_state_is_each_ranks_own_and_resumed_exactly_on_two_simulated_gaudis",),
         device=False),
    Undo("fsdp-of-this-run", "37.4", (("optimum_gaudi/distributed/fsdp.py",
                                       "    if _fsdp_exported_by_a_trainer and not wants_fsdp:",
                                       "    if False:"),),
         (f"{COMMANDS}::test_fsdp_and_long_sequence_commands_train_as_ddp_on_simulated_gaudis[2]",), device=False),
    # issue 38: a rank stopped before its watchdog's first tick (CI once saw the other rank name itself)
    Undo("watchdog-first-beat", "38.2", (("optimum_gaudi/supervision/watchdog.py",
                                          "        with contextlib.suppress(StoreGone):\n            self._publish()\n",
                                          ""),
                                         ("optimum_gaudi/supervision/watchdog.py",
                                          "            return self._armed and now - self._armed_at >= self.limit",
                                          "            return False"),),
         (f"{STALLS}::test_a_rank_stopped_before_its_watchdogs_first_tick_is_named_as_stopped",), device=False),
    Undo("watchdog-hold", "38.2", (("optimum_gaudi/supervision/watchdog.py",
                                    "        if self._ending.is_set():\n            threading.Event().wait()\n",
                                    "        pass\n"),),
         (f"{STALLS}::test_once_a_verdict_is_known_the_training_loop_makes_no_more_progress",), device=False),
    # issue 39's CI: a stopped rank continued before the others wrote their reports moved them on
    Undo("watchdog-continue-last", "38.2", (("optimum_gaudi/supervision/watchdog.py",
                                             '        self._wait_for([self._key(f"done/{r}") for r in others if not '
                                             "self._frozen(r, now)], ticks + 5)\n", ""),),
         (f"{STALLS}::test_a_stopped_rank_is_continued_only_once_every_running_rank_wrote_where_it_waits",),
         device=False),
    # fast_ddp's marker seen through by the accelerator's unwrap_model (label smoothing shifted no labels)
    Undo("fast-ddp-unwrap", "39", (("optimum_gaudi/trainers/trainer.py",
                                    "            unwrap_the_marker_too(self.accelerator)\n", "            pass\n"),),
         ("integration/distributed/test_fast_ddp.py::"
          "test_fast_ddp_trains_a_llama_as_ddp_does_with_a_loss_that_reads_the_model_twice",), device=False),
    # the fused loss's hidden states cut to the real rows a short batch padded in the forward gives its labels
    Undo("fused-loss-cut", "39", (("optimum_gaudi/features/linear_cross_entropy.py",
                                   "            hidden = hidden[: labels.shape[0]]", "            pass"),),
         ("integration/features/test_linear_cross_entropy.py::"
          "test_a_short_batch_padded_in_the_forward_gives_the_models_own_losses",), device=False),
    # training graphs laid on the model under an earlier train()'s wrapper, not on the wrapper
    Undo("graphs-under-wrapper", "39", (("optimum_gaudi/preparation/pipeline.py",
                                         "        inner = self.trainer.accelerator.unwrap_model(model, keep_torch_compile=False)\n"
                                         '        seam = Seam.of(inner, "forward")\n',
                                         '        inner = model\n        seam = Seam.of(inner, "forward")\n'),),
         ("integration/distributed/test_fast_ddp.py::"
          "test_hpu_graphs_go_on_the_model_once_whatever_wraps_it_on_two_simulated_gaudis",), device=False),
    # issue 46: host groups beside an hccl default group never take the timeout hccl dropped
    Undo("host-groups-beside-hccl", "46.1", (("optimum_gaudi/distributed/host_group.py",
                                              "            if _backend_of(world, device) not in TIMED_BACKENDS:\n"
                                              "                continue\n", ""),),
         ("unit/distributed/test_parallel_layout.py::"
          "test_host_groups_wait_the_runs_timeout_not_what_an_hccl_default_group_holds",), device=False),
    # issue 46: a step fp16's gradient scaler skips for an overflow is left to it
    Undo("nonfinite-scaler-overflow", "46.6", (("optimum_gaudi/supervision/nonfinite.py",
                                                "            if self._scaler_found_inf():", "            if False:"),),
         ("unit/supervision/test_nonfinite.py::test_steps_the_gradient_scaler_skips_for_an_overflow_are_left_to_it",),
         device=False),
    # issue 46: a step that may compile, and every pause, is watched with the long limit, here and on the ranks
    # waiting for it
    Undo("watchdog-compile-limit", "46.3", (("optimum_gaudi/supervision/watchdog.py",
                                             "        return self._paused if self._paused is not None else COMPILING "
                                             "if self._compiling is not None else None",
                                             "        return self._paused"),),
         (f"{STALLS}::test_a_step_that_may_compile_is_watched_with_the_long_limit_on_every_rank",), device=False),
    Undo("watchdog-compiling-peer", "46.3", (("optimum_gaudi/supervision/watchdog.py",
                                              "windows = [b.paused or COMPILING for b in others if b.paused or "
                                              "b.compiling]", "windows = [b.paused for b in others if b.paused]"),
                                             ("optimum_gaudi/supervision/watchdog.py",
                                              "        limit = self.window_limit(COMPILING) if compiling else "
                                              "self.limit", "        limit = self.limit"),),
         (f"{STALLS}::test_a_step_that_may_compile_is_watched_with_the_long_limit_on_every_rank",), device=False),
    Undo("watch-compiling-steps", "46.3", (("optimum_gaudi/supervision/watch.py",
                                            "        if self._steps_begun <= self._compiling_first_steps:",
                                            "        if False:"),),
         (f"{STALLS}::test_on_a_gaudi_the_first_three_steps_of_each_process_and_new_shapes_are_compiling_steps",
          "integration/supervision/test_stalled_slow_or_diverging_ranks.py::test_on_simulated_gaudis_a_long_compile_"
          "in_step_2_never_fires_and_a_stall_in_step_3_fires_after_the_long_limit"), device=False),
    Undo("watchdog-bounded-pauses", "46.2", (("optimum_gaudi/supervision/watchdog.py",
                                              "        if stalled_for < (self.window_limit(window) if window is not "
                                              "None else self.limit):\n",
                                              "        if self._paused is not None or stalled_for < (self.window_"
                                              "limit(window) if window is not None else self.limit):\n"),
                                             ("optimum_gaudi/supervision/watchdog.py",
                                              "        if windows and stalled_for < max(map(self.window_limit, "
                                              "windows)):\n",
                                              "        if any(b.paused for b in others) or windows and stalled_for < "
                                              "max(map(self.window_limit, windows)):\n"),),
         (f"{STALLS}::test_a_hang_in_the_first_step_a_save_or_an_evaluation_fires_after_the_long_limit",),
         device=False),
    Undo("watchdog-window-limits", "46.2", (("optimum_gaudi/supervision/watchdog.py",
                                             "WINDOW_FACTOR * self.longest.get(window or \"\", 0.0))",
                                             "WINDOW_FACTOR * max(self.longest.values(), default=0.0))"),),
         (f"{STALLS}::test_each_window_has_a_limit_of_its_own_from_the_runs_measured_times_above_a_floor",),
         device=False),
    # a rank stopped as a step ended read as 'behind' a tick before its silence reached the limit (4-rank stall test)
    Undo("watchdog-silent-at-the-stall", "46.1", (("optimum_gaudi/supervision/watchdog.py",
                                                   "        silent = [rank for rank in behind if rank != self.rank and "
                                                   "self._silent_since_the_stall(rank, now)]",
                                                   "        silent = []"),),
         (f"{STALLS}::test_a_rank_stopped_as_a_step_ended_is_named_as_stopped_not_behind",), device=False),
    # issue 46: where the backend keeps no collective count (HCCL) the project's own tells the ranks apart, and DDP's
    # counting hook keeps the reducer's bits
    Undo("collective-count", "46.4", (("optimum_gaudi/supervision/watchdog.py",
                                       "    return count.default_count() if count is not None else -1",
                                       "    return -1"),
                                      ("optimum_gaudi/supervision/watchdog.py",
                                       "    counted = count.waiting_in() if count is not None else None",
                                       "    counted = None"),),
         ("integration/supervision/test_stalled_slow_or_diverging_ranks.py::test_a_collective_the_others_never_join_"
          "within_a_step_names_its_rank_on_simulated_gaudis_as_on_gloo",), device=False),
    Undo("collective-count-compiling", "46.4", (("optimum_gaudi/supervision/collective_count.py",
                                                 "        if compiling() or count is None or _depth.n:",
                                                 "        if count is None or _depth.n:"),),
         (f"{COUNT}::test_a_compiled_function_calling_a_collective_compiles_into_the_same_graph_with_the_count_on",),
         device=False),
    Undo("ddp-hook-scaling", "46.4", (("optimum_gaudi/supervision/collective_count.py",
                                       "    buffer.mul_(1.0 / group.size())", "    buffer.div_(group.size())"),),
         (f"{COUNT}::test_the_counting_hook_gives_ddps_gradients_bit_for_bit_and_is_refused_where_it_could_not",),
         device=False),
    Undo("ddp-hook-refused", "46.4", (("optimum_gaudi/supervision/collective_count.py",
                                       "    return not gradient_as_bucket_view or group_size & (group_size - 1) == 0",
                                       "    return True"),),
         (f"{COUNT}::test_the_counting_hook_gives_ddps_gradients_bit_for_bit_and_is_refused_where_it_could_not",),
         device=False),
    # two trainers in one process share the count; a training loop begun again ends its first watchdog
    Undo("count-shared", "46.4", (("optimum_gaudi/supervision/collective_count.py", "    _users += 1\n",
                                   "    _users = 1\n"),),
         (f"{COUNT}::test_a_second_trainer_shares_the_running_count_hooks_its_own_ddp_module_and_does_not_end_the_"
          "firsts",), device=False),
    Undo("watch-begun-again", "46.4", (("optimum_gaudi/supervision/watch.py",
                                        "        self.stop()\n        store = default_store()",
                                        "        store = default_store()"),),
         (f"{WATCH}::test_a_training_loop_begun_again_ends_its_first_watchdog_and_counts_the_new_ddp_module",),
         device=False),
    # on NCCL the report reads NCCL's own flight recorder, which gloo's does not hold
    Undo("nccl-recorder", "46.4", (("optimum_gaudi/supervision/collective_count.py",
                                    '        dump = getattr(c10d, "_dump_nccl_trace_json", None)\n',
                                    '        dump = getattr(c10d, "_dump_fr_trace_json", None)\n'),),
         (f"{STALLS}::test_on_nccl_the_report_names_the_collective_from_ncclS_own_recorder",
          f"{COUNT}::test_on_nccl_its_own_recorder_names_the_collectives_once_the_arguments_turn_it_on"),
         device=False),
)  # fmt: skip


def run(undo: Undo) -> str:
    """The last line of the test run without the fix."""
    originals = {path: (REPO / path).read_text() for path, _, _ in undo.edits}
    texts = dict(originals)
    for path, fixed, without in undo.edits:
        if texts[path].count(fixed) != 1:
            raise SystemExit(f"error: {undo.label}: the fix's text is not found once in {path}; update this script")
        texts[path] = texts[path].replace(fixed, without)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_HPU", "FAKE_HPU", "PYTHONPATH"))}
    # this checkout's package, the one edited here: pytest runs from tests/, and without it a work tree beside the
    # one the editable install points at would test the other tree's code, edits or not
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    if undo.device:
        env.update(PYTHONPATH=os.pathsep.join([str(TESTS / "fakes"), str(REPO)]), FAKE_HPU_DEVICE="1")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *undo.tests]
    try:
        for path, text in texts.items():
            (REPO / path).write_text(text)
        result = subprocess.run(command, cwd=TESTS, env=env, capture_output=True, text=True, timeout=900)
    finally:
        for path, text in originals.items():
            (REPO / path).write_text(text)
    lines = result.stdout.strip().splitlines()
    return lines[-1] if lines else result.stderr.strip()[-200:]


def main(labels: list[str]) -> int:
    unknown = set(labels) - {u.label for u in UNDOS}
    if unknown:
        print(f"error: no undo named {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    undos = [u for u in UNDOS if not labels or u.label in labels]
    paths = sorted({path for u in undos for path, _, _ in u.edits})
    if subprocess.run(["git", "diff", "--quiet", "--", *paths], cwd=REPO).returncode != 0:
        print("error: the files this script edits have changes; commit or stash them first", file=sys.stderr)
        return 2
    wrong = []
    for undo in undos:
        last = run(undo)
        print(
            f"{undo.label:<26} point {undo.point:<9} {'device' if undo.device else 'host  '}  without the fix: {last}"
        )
        # an error (collection, import) means the undo broke the code, which proves nothing about the test
        if " failed" not in last or " error" in last:
            wrong.append(undo.label)
    if wrong:
        print(f"these undos did not make their tests fail (passed, or errored): {', '.join(wrong)}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
