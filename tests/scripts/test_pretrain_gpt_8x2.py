"""scripts/pretrain_gpt_8x2.sh as a long job on N nodes needs it: each node's own address, the flags a long
run needs, and a command the trainer's parser takes (one dry run of four nodes)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pretrain_gpt_8x2.sh"
HOSTS = ["10.1.0.11", "10.1.0.12", "localhost", "10.1.0.14"]


@pytest.mark.launch
def test_dry_run_gives_each_node_its_own_address_and_a_long_jobs_flags():
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "HOSTS": ",".join(HOSTS),
        "NNODES": "4",
        "PP": "4",
        "RANK_MAP_CHECK": "0",
    }
    env.pop("HCCL_IF_IP", None)
    res = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    addresses = [line.split("=", 1)[1] for line in res.stdout.splitlines() if line.startswith("export HCCL_IF_IP=")]
    # every node's HOSTS entry (a name resolved), not the address of the machine the dry run ran on
    assert addresses == ["10.1.0.11", "10.1.0.12", "127.0.0.1", "10.1.0.14"]
    commands = [line for line in res.stdout.splitlines() if "torch.distributed.run" in line]
    assert len(commands) == 4
    words = shlex.split(commands[3])
    args = words[words.index(next(w for w in words if w.endswith("pretrain_gpt.py"))) + 1 :]
    for flag in ("--exit-signal-handler", "--save", "--load", "--save-interval", "--log-dir", "--tensorboard-dir"):
        assert flag in args, flag
    assert args[args.index("--save") + 1] == args[args.index("--load") + 1]  # a restart resumes the same run
    from megatron_npu.training.arguments import parse_args

    parsed = parse_args(args, world_size=32, check_paths=False)
    assert parsed.exit_signal_handler and parsed.tensorboard_dir.endswith("/tensorboard")
    assert (parsed.tensor_model_parallel_size, parsed.pipeline_model_parallel_size) == (8, 4)
