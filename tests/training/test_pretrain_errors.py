"""Bad input to pretrain_gpt.py: one clear message naming the flags, exit status 2, no traceback, no hang.

Every check runs before any process group exists, so each case is checked through
``pretrain()`` in this process; two cases also go through the real command line
(one plain process, one 2-rank torchrun job whose ranks must all exit).
"""

from __future__ import annotations

import sys

import pytest
from distributed import ROOT, base_env, run, torchrun
from pretrain_runs import MOCK_DATA, MODEL, PRETRAIN

sys.path.insert(0, str(ROOT))


def flags(*changes: str, drop: tuple[str, ...] = ()) -> list[str]:
    """MODEL flags with ``changes`` (flag, value pairs or switches) replacing or adding to them."""
    out = [*MODEL, *MOCK_DATA]
    for flag in drop:
        index = out.index(flag)
        has_value = index + 1 < len(out) and not out[index + 1].startswith("--")
        del out[index : index + 1 + has_value]
    return [*out, "--train-iters", "3", *changes]


CASES = {
    "world_not_divisible": (
        6,
        flags("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"),
        ["--tensor-model-parallel-size", "--pipeline-model-parallel-size", "6"],
    ),
    "heads_vs_tp": (
        4,
        flags("--tensor-model-parallel-size", "4", "--num-attention-heads", "6", "--hidden-size", "96"),
        ["--num-attention-heads", "6", "--tensor-model-parallel-size"],
    ),
    "query_groups_vs_tp": (
        2,
        flags("--tensor-model-parallel-size", "2", "--group-query-attention", "--num-query-groups", "1"),
        ["--num-query-groups", "--tensor-model-parallel-size"],
    ),
    "layers_vs_pp": (
        3,
        flags("--pipeline-model-parallel-size", "3"),
        ["--num-layers", "--pipeline-model-parallel-size"],
    ),
    "layers_vs_virtual_stages": (
        2,
        flags("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"),
        ["--num-layers-per-virtual-pipeline-stage"],
    ),
    "wandb_without_a_name": (1, flags("--wandb-project", "p", "--save", "/tmp/unused"), ["--wandb-exp-name"]),
    "global_batch_vs_dp": (4, flags("--global-batch-size", "6"), ["--global-batch-size", "--micro-batch-size"]),
    "seq_length_vs_positions": (1, flags("--seq-length", "64"), ["--seq-length", "--max-position-embeddings"]),
    "missing_data": (
        1,
        flags("--data-path", "/nonexistent/corpus_text_document", drop=("--mock-data",)),
        ["/nonexistent/corpus_text_document", "megatron-npu preprocess"],
    ),
    "missing_tokenizer": (
        1,
        flags("--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "/nonexistent/tok.model"),
        ["--tokenizer-model", "/nonexistent/tok.model"],
    ),
    "unknown_flag": (1, flags("--no-such-flag"), ["--no-such-flag"]),
    "fp8_refused": (1, flags("--fp8-format", "hybrid"), ["--fp8-format", "--bf16"]),
}


@pytest.fixture(scope="module")
def pretrain_gpt():
    import pretrain_gpt

    return pretrain_gpt


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_configuration_exits_with_one_message_before_any_process_group(name, pretrain_gpt, monkeypatch, capsys):
    import torch.distributed as dist

    world_size, argv, must_name = CASES[name]
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    status = pretrain_gpt.pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        pretrain_gpt.model_provider,
        None,
        pretrain_gpt.forward_step,
        argv=argv,
    )
    err = capsys.readouterr().err
    assert status == 2
    assert not dist.is_initialized()
    lines = [line for line in err.splitlines() if line.startswith("megatron-npu: error:")]
    assert len(lines) == 1, err
    for text in must_name:
        assert text in lines[0], lines[0]


@pytest.mark.launch
def test_command_line_error_has_no_traceback():
    job = run(
        [sys.executable, str(PRETRAIN), *flags("--pipeline-model-parallel-size", "3")],
        env=base_env(WORLD_SIZE="3", RANK="0"),
        timeout=600,
    )
    assert job.returncode == 2
    assert "megatron-npu: error:" in job.stderr and "--num-layers" in job.stderr
    assert "Traceback" not in job.stderr


@pytest.mark.launch
def test_every_rank_of_a_torchrun_job_exits_on_a_bad_layout():
    job = torchrun(PRETRAIN, *flags("--tensor-model-parallel-size", "4"), nproc=2, timeout=600)
    assert job.returncode != 0
    # torchrun's failure summary names the message once, as the root cause, whichever rank exits first
    assert job.stderr.count("megatron-npu: error:") == 1, job.stderr
    root_cause = job.stderr.split("Root Cause (first observed failure):", 1)[1].split("=" * 20, 1)[0]
    assert "megatron-npu: error: world size 2 is not divisible" in root_cause, job.stderr
    assert "[rank0]: Traceback" not in job.stderr and "[rank1]: Traceback" not in job.stderr


@pytest.mark.parametrize("rank", [0, 1])
def test_a_start_error_is_written_to_torchruns_error_file_by_any_rank(rank, tmp_path, monkeypatch, capsys):
    """The rank that exits first (rank 0 at once, another after its grace) leaves the message for torchrun."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from megatron_npu.start_errors import report_start_error

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", str(rank))
    assert report_start_error("--tensor-model-parallel-size 4 does not divide 2 ranks", grace_s=0.0) == 2
    assert capsys.readouterr().err == ""  # torchrun prints it, once
    failure = ProcessFailure(local_rank=rank, pid=1, exitcode=2, error_file=str(error_file))
    assert failure.message == "megatron-npu: error: --tensor-model-parallel-size 4 does not divide 2 ranks"


def test_the_demo_command_is_a_valid_pretrain_gpt_configuration(tmp_path):
    """`megatron-npu demo` runs pretrain_gpt.py with these flags on 4 ranks: they must pass every check."""
    import argparse

    from megatron_npu import demo
    from megatron_npu.data import DEMO_TOKENIZER_MODEL, ensure_demo_dataset
    from megatron_npu.training.arguments import parse_args

    options = argparse.Namespace(iters=100, tp=2, pp=2, nproc=4)
    command = demo.build_command(options, ensure_demo_dataset(str(tmp_path)), DEMO_TOKENIZER_MODEL, tmp_path)
    argv = command[command.index(str(demo.PRETRAIN)) + 1 :]
    args = parse_args(argv, world_size=4)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.train_iters) == (2, 2, 100)
