"""The losses of tiny trainings that exercise precision, recorded exactly, to compare two versions of the package.

    python tests/scripts/precision_losses.py record OUT.json [CASE ...]   # every case unless named; a few minutes
    python tests/scripts/precision_losses.py compare BEFORE.json AFTER.json

A refactoring of precision (op lists, the op-list autocast, accelerate's bf16, fp8 with torchao on CPU and with
the Transformer Engine on the simulated Gaudi, its scaling state saved and resumed, FSDP's bf16 gathers) must
leave every number here bit-equal. Each case trains in a process of its own (the simulated bridge, torchao and
accelerate's state are process-wide); the FSDP cases run under torchrun through tests/scripts/fsdp_features.py.
``compare`` prints each case and exits 1 where any number differs in any bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
FAKES = TESTS / "fakes"
TORCHAO = REPO / ".venv-torchao"

# case -> (model, Gaudi config, training arguments, simulated Gaudi software or None for CPU, extra environment)
LLAMA_FP8 = dict(hidden_size=64, intermediate_size=128)  # widths fp8 converts (multiples of 16)
ATTENTION = dict(attn_implementation="gaudi_fused_sdpa", flash_attention_recompute=True)
CASES = {
    "cpu_fp32": ("llama", {}, {}, None, {}),
    "cpu_bf16_accelerate": ("llama", {}, {"bf16": True}, None, {}),
    "cpu_op_lists_habana_default": ("llama", {"use_torch_autocast": True}, {"bf16": True}, None, {}),
    "cpu_op_lists_gpt2_config": ("gpt2", "gpt2", {"bf16": True}, None, {}),
    "cpu_op_lists_given": (
        "llama",
        {
            "use_torch_autocast": True,
            "autocast_bf16_ops": ["linear", "mm", "mul", "softmax", "scaled_dot_product_attention"],
        },
        {"bf16": True},
        None,
        {},
    ),
    "cpu_op_lists_compiled": (
        "llama",
        {"use_torch_autocast": True},
        {"bf16": True, "torch_compile_backend": "aot_eager", "use_regional_compilation": True},
        None,
        {},
    ),
    "cpu_fp8_torchao": ("llama_fp8", {}, {"bf16": True, "fp8": True}, None, {}),
    "sim_op_lists_1.21": ("llama", {"use_torch_autocast": True}, {"bf16": True, "use_habana": True}, "1.21", {}),
    "sim_bf16_graphs_lazy_1.19": (
        "llama",
        {},
        {"bf16": True, "use_habana": True, "use_lazy_mode": True, "use_hpu_graphs_for_training": True},
        "1.19",
        {},
    ),
    "sim_fp8_te_1.21": ("llama_fp8", {}, {"bf16": True, "use_habana": True, "fp8": True}, "1.21", {}),
    "sim_fp8_te_checkpointing_1.19": (
        "llama_fp8",
        {},
        {"bf16": True, "use_habana": True, "use_lazy_mode": True, "fp8": True, "gradient_checkpointing": True},
        "1.19",
        {},
    ),
    "sim_fp8_attention_resumed_1.21": (
        "llama_fp8",
        {},
        {"bf16": True, "use_habana": True, "fp8": True, "flash_attention_fp8": True, **ATTENTION},
        "1.21",
        {"FAKE_HPU_DEVICE_NAME": "GAUDI3", "FAKE_HPU_TE_EXTRA_STATE": "bytesio"},
    ),
}
TORCHRUN_CASES = ("fsdp_cpu_autocast_fp8", "fsdp_sim_resume")


def model(name: str):
    import tiny

    if name == "gpt2":
        return tiny.gpt2(**tiny.NO_DROPOUT)
    return tiny.llama(**(LLAMA_FP8 if name == "llama_fp8" else {}))


def run_case(name: str, out_dir: str) -> dict:
    """Train the case in this process: each logged loss and gradient norm, the evaluation loss; a case saving
    checkpoints is resumed from its first one too."""
    import torch

    if name in ("cpu_fp8_torchao",):
        sys.path.append(str(TORCHAO))
    kind, config, flags, software, _ = CASES[name]
    if software is not None:  # the simulated bridge, as tests/conftest.py's bridge fixture puts it
        for var in [v for v in os.environ if v.startswith(("PT_HPU", "PT_TE_"))]:
            del os.environ[var]
        sys.path.insert(0, str(FAKES))
        torch.cuda.is_available = lambda: False
        torch.cuda.device_count = lambda: 0
        import transformers.training_args

        transformers.training_args.is_torch_bf16_gpu_available = lambda: True
    import tiny

    from optimum_gaudi import GaudiConfig, GaudiTrainer, GaudiTrainingArguments

    resumed = "resumed" in name

    def train(folder: str, checkpoint: str | None = None) -> GaudiTrainer:
        args = GaudiTrainingArguments(
            output_dir=os.path.join(out_dir, folder), max_steps=6 if resumed else 4, logging_steps=1,
            per_device_train_batch_size=4, learning_rate=3e-3, report_to=[], seed=0, disable_tqdm=True,
            save_strategy="steps" if resumed else "no", save_steps=3, train_sampling_strategy="sequential",
            **({"gaudi_config_name": config} if isinstance(config, str) else {}), **flags,
        )  # fmt: skip
        gaudi_config = GaudiConfig(**config) if isinstance(config, dict) else None
        trainer = GaudiTrainer(
            model=model(kind), args=args, train_dataset=tiny.lm_data(), eval_dataset=tiny.lm_data(8),
            gaudi_config=gaudi_config,
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=checkpoint)
        return trainer

    trainer = train("whole")
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result = {
        "losses": [h["loss"] for h in logs],
        "grad_norms": [h["grad_norm"] for h in logs],
        "eval_loss": trainer.evaluate()["eval_loss"],
        "weights_sum": float(sum(p.detach().double().sum() for p in trainer.model.parameters())),
    }
    if resumed:
        again = train("resumed", os.path.join(out_dir, "whole", "checkpoint-3"))
        result["resumed_losses"] = [h["loss"] for h in again.state.log_history if "loss" in h]
    return result


def torchrun(name: str, out_dir: str) -> dict:
    """tests/scripts/fsdp_features.py on 2 processes: FSDP's bf16 gathers under the op-list autocast and torchao's
    fp8 on CPU; or, on 2 simulated Gaudis, FSDP with the op-list autocast saved and resumed and the Transformer
    Engine's per-rank scaling state saved and resumed under DDP."""
    out = os.path.join(out_dir, "results.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PT_HPU", "FAKE_HPU", "RANK", "WORLD_SIZE"))}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    if name == "fsdp_cpu_autocast_fp8":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(TORCHAO)]))
        modes, cases = "fsdp", ["autocast", "fp8"]
    else:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAKES), env.get("PYTHONPATH")]))
        env.update(FAKE_HPU_DEVICE="1", FAKE_HPU_DEVICE_COUNT="2", FAKE_HPU_SOFTWARE="1.21")
        env.update(FAKE_HPU_CALL_LOG=os.path.join(out_dir, "simulator.json"), FAKE_HPU_TE_EXTRA_STATE="bytesio")
        modes, cases = "resume", []
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
    command += ["--master_port", str(_free_port()), str(TESTS / "scripts" / "fsdp_features.py"), out, modes, *cases]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{name}: torchrun failed\n{done.stderr[-3000:]}")
    results = {}
    for rank in (0, 1):
        ranks = json.loads(Path(f"{out}.{rank}").read_text())
        results[f"rank{rank}"] = _numbers(ranks)
    return results


def _numbers(value):
    """The losses, gradient norms and amax histories of fsdp_features.py's results (what precision decides)."""
    if isinstance(value, dict):
        kept = {k: _numbers(v) for k, v in value.items() if k not in ("memory", "checkpoint", "files", "bridge_calls")}
        return {k: v for k, v in kept.items() if v not in (None, {}, [])}
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    return value if isinstance(value, (int, float, str)) else None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record(out: str, names: list[str]) -> None:
    results = {}
    for name in names:
        with tempfile.TemporaryDirectory() as folder:
            if name in TORCHRUN_CASES:
                results[name] = torchrun(name, folder)
            else:
                result = Path(folder) / "result.json"
                env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **CASES[name][4]}
                command = [sys.executable, __file__, "case", name, folder, str(result)]
                done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
                if done.returncode != 0:
                    raise SystemExit(f"{name} failed\n{done.stderr[-3000:]}")
                results[name] = json.loads(result.read_text())
        print(name, json.dumps(results[name])[:160], flush=True)
    Path(out).write_text(json.dumps(results, indent=1))


def compare(before: str, after: str) -> int:
    a, b = json.loads(Path(before).read_text()), json.loads(Path(after).read_text())
    differ = 0
    for name in sorted(set(a) | set(b)):
        same = a.get(name) == b.get(name)  # floats from JSON: equal values are equal bits
        differ += not same
        print(f"{'bit-equal' if same else 'DIFFERENT'}  {name}")
    print(f"{len(set(a) | set(b)) - differ} of {len(set(a) | set(b))} cases bit-equal")
    return 1 if differ else 0


def main(argv: list[str]) -> int:
    if argv[0] == "case":  # a child: one case in this process
        sys.path.insert(0, str(TESTS))
        name, folder, out = argv[1:4]
        Path(out).write_text(json.dumps(run_case(name, folder)))
        return 0
    if argv[0] == "record":
        record(argv[1], argv[2:] or [*CASES, *TORCHRUN_CASES])
        return 0
    if argv[0] == "compare":
        return compare(argv[1], argv[2])
    raise SystemExit(__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
