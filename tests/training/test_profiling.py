"""--profile: refused without a log dir (it would be silently off), and the accelerator's own trace output on a
target whose profiler writes a tool's layout (torch_npu's for MindStudio Insight) instead of a Chrome trace."""

from __future__ import annotations

from typing import Any

import pytest

from megatron_npu.policy import ConfigError
from megatron_npu.training import profiler as profiler_module
from megatron_npu.training.arguments import parse_args
from megatron_npu.training.sections import ProfilingSection

MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
    "--micro-batch-size 1 --global-batch-size 2 --train-iters 4 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 256"
).split()


def test_profile_without_a_log_dir_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^--profile writes its traces to LOG_DIR/profile/: give --log-dir"):
        parse_args([*MODEL, "--profile"], world_size=1, check_paths=False)
    assert parse_args([*MODEL, "--profile", "--log-dir", "/tmp/x"], world_size=1, check_paths=False).profile


class _ToolProfiler:
    def __init__(self, trace_dir: str, name: str) -> None:
        self.trace_dir, self.name, self.stopped, self.exported = trace_dir, name, False, False

    def __enter__(self) -> _ToolProfiler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stopped = True  # torch_npu's on_trace_ready writes here

    def export_chrome_trace(self, path: str) -> None:
        self.exported = True


class _Accelerator:
    profiler_output = "MindStudio Insight"

    def __init__(self) -> None:
        self.made: list[_ToolProfiler] = []

    def profiler(self, trace_dir: str, name: str) -> _ToolProfiler:
        self.made.append(_ToolProfiler(trace_dir, name))
        return self.made[-1]


def test_a_tool_layout_is_left_to_the_profiler_that_writes_it(tmp_path, monkeypatch, capsys):
    accelerator = _Accelerator()
    monkeypatch.setattr(profiler_module, "get_accelerator", lambda: accelerator)
    monkeypatch.setattr(profiler_module.dist, "get_rank", lambda: 3)
    monkeypatch.setattr(profiler_module, "print_rank_0", print)
    section = ProfilingSection(profile=True, profile_step_start=2, profile_step_end=4, profile_ranks=(3,))
    step = profiler_module.StepProfiler(section, str(tmp_path))
    for iteration in range(1, 6):
        step.before(iteration)
        step.after(iteration)
    (made,) = accelerator.made
    assert (made.trace_dir, made.name) == (str(tmp_path / "profile"), "rank00003")
    assert made.stopped and not made.exported
    assert f"written to {tmp_path}/profile/rank00003_*  (for MindStudio Insight)" in capsys.readouterr().out
