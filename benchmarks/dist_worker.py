"""One training run of a small GPT-2 (4x256) for benchmarks/distributed.py; started directly or under torchrun.

`dist_worker.py OUT.json STEPS WARMUP [GaudiTrainingArguments flags...]`: rank 0 writes steps/s after
warm-up and the final training loss.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import HfArgumentParser  # noqa: E402

from benchmarks.common import StepClock, gpt2, lm_data  # noqa: E402
from optimum_gaudi import GaudiTrainer, GaudiTrainingArguments  # noqa: E402

SMALL = dict(n_layer=4, n_embd=256, n_head=4)


def main() -> None:
    out, steps, warmup, flags = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    if "--bench_gaudi_ddp_settings" in flags:  # the DDP settings a Gaudi gets, here on the CPU
        from optimum_gaudi.devices.base import Device
        from optimum_gaudi.devices.hpu import HPUDevice

        flags.remove("--bench_gaudi_ddp_settings")
        Device.ddp_defaults = HPUDevice.ddp_defaults
    with tempfile.TemporaryDirectory() as tmp:
        common = ["--output_dir", tmp, "--max_steps", str(steps), "--report_to", "none", "--save_strategy", "no"]
        common += ["--logging_steps", str(steps), "--disable_tqdm", "true", "--learning_rate", "1e-3", "--seed", "0"]
        (args,) = HfArgumentParser(GaudiTrainingArguments).parse_args_into_dataclasses(common + flags)
        tokenizer, train, _ = lm_data(train_blocks=steps * 16, eval_blocks=1)
        clock = StepClock(warmup)
        trainer = GaudiTrainer(model=gpt2(tokenizer, **SMALL), args=args, train_dataset=train, callbacks=[clock])
        trainer.train()
    if trainer.is_world_process_zero():
        loss = [h["loss"] for h in trainer.state.log_history if "loss" in h][-1]
        result = {"steps_per_second": 1 / clock.seconds_per_step, "loss": loss, "threads": torch.get_num_threads()}
        Path(out).write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # Seen here: after everything above returned, a rank sometimes never finished interpreter exit (FSDP over
    # gloo on CPU, both threads idle), which keeps torchrun waiting. The results are written: leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
