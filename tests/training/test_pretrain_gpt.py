"""pretrain_gpt.py: Megatron-LM's trainer surface on megatron-core, proven by real cpu runs.

Five launches: a 1-rank run with dropout that saves at iteration 3 and its resume;
a 1-rank dropout-free TP1 reference saved at iteration 3; that checkpoint loaded
under TP2 x DP2 (sequence parallel, distributed optimizer, overlapped grad reduce)
and under TP2 x PP2 x VPP2 (interleaved pipeline), each trained on to iteration 6.
"""

from __future__ import annotations

import json
import re

import pytest
from pretrain_runs import NO_DROPOUT, checkpoint_at, pretrain, train_losses, validation_losses

pytestmark = pytest.mark.launch  # every test here starts processes

ITERS = ["--train-iters", "6"]
# The embedding and output layer on their own schedule (lr 1e-3 -> 1e-4 for the rest, MODEL)
DECOUPLED = ["--decoupled-lr", "5e-3", "--decoupled-min-lr", "5e-4"]
ITERATION_LINE = re.compile(
    r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +(\d+)/ +6 \| consumed samples: +(\d+) \| "
    r"elapsed time per iteration \(ms\): [\d.]+ \| learning rate: [\d.]+E[-+]\d\d \| "
    r"(?:decoupled learning rate: [\d.]+E[-+]\d\d \| )?global batch size: +8 \| "
    r"lm loss: (\d\.\d{6}E[-+]\d\d) \| loss scale: 1\.0 \| grad norm: [\d.]+ \| "
    r"number of skipped iterations: +0 \| number of nan iterations: +0 \|"
)


@pytest.fixture(scope="module")
def dropout_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("dropout")
    job = pretrain(
        run,
        *ITERS,
        *DECOUPLED,
        "--use-distributed-optimizer",
        "--save",
        str(run / "ckpt"),
        "--save-interval",
        "3",
        "--tensorboard-dir",
        str(run / "tb"),
        "--wandb-project",
        "megatron-npu-tests",
        "--wandb-exp-name",
        "dropout",
        "--wandb-save-dir",
        str(run / "wb"),
        "--profile",
        "--profile-step-start",
        "2",
        "--profile-step-end",
        "3",
    ).check()
    return run, job


@pytest.fixture(scope="module")
def resumed_run(dropout_run, tmp_path_factory):
    """Resumes at 3 from a root that also holds what a save killed at iteration 6 leaves behind."""
    source, _ = dropout_run
    run = tmp_path_factory.mktemp("resumed")
    root = checkpoint_at(source / "ckpt", 3, run / "ckpt")
    killed = root / "iter_0000006.partial"
    killed.mkdir()
    (killed / "__0_0.distcp").write_bytes(b"half a shard")
    job = pretrain(
        run,
        *ITERS,
        *DECOUPLED,
        "--use-distributed-optimizer",
        "--load",
        str(root),
        "--save",
        str(root),
        "--save-interval",
        "3",
    ).check()
    return run, job


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("tp1")
    pretrain(
        run, *ITERS, *NO_DROPOUT, "--use-distributed-optimizer", "--save", str(run / "ckpt"), "--save-interval", "3"
    ).check()
    return run


def _resharded(reference_run, tmp_path_factory, name, *layout):
    run = tmp_path_factory.mktemp(name)
    load = checkpoint_at(reference_run / "ckpt", 3, run / "ckpt")
    job = pretrain(run, *ITERS, *NO_DROPOUT, "--load", str(load), "--timing-log-level", "1", *layout, nproc=4)
    return run, job.check()


@pytest.fixture(scope="module")
def tp2_dp2_run(reference_run, tmp_path_factory):
    return _resharded(
        reference_run,
        tmp_path_factory,
        "tp2dp2",
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
    )


@pytest.fixture(scope="module")
def tp2_pp2_vpp2_run(reference_run, tmp_path_factory):
    return _resharded(
        reference_run,
        tmp_path_factory,
        "vpp",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
        "--use-distributed-optimizer",
    )


def assert_close(actual: dict[int, float], expected: dict[int, float], rel: float) -> None:
    assert actual.keys() == expected.keys(), (actual, expected)
    for iteration, value in actual.items():
        assert abs(value - expected[iteration]) <= rel * abs(expected[iteration]), (
            iteration,
            value,
            expected[iteration],
        )


def test_iteration_lines_have_megatron_lm_shape_and_the_loss_falls(dropout_run):
    run, job = dropout_run
    lines = [ITERATION_LINE.match(line) for line in job.stdout.splitlines() if "] iteration " in line]
    assert len(lines) == 6 and all(lines), job.stdout[-3000:]
    assert [int(m.group(1)) for m in lines] == [1, 2, 3, 4, 5, 6]
    assert [int(m.group(2)) for m in lines] == [8, 16, 24, 32, 40, 48]
    printed = [float(m.group(3)) for m in lines]
    assert printed == pytest.approx(list(train_losses(run).values()), rel=1e-6)
    assert printed[-1] < printed[0]
    assert job.stdout.count(" validation loss at iteration ") == 5  # iterations 2, 4, 6, the final one, the test set
    assert " validation loss at iteration 6 on test set |" in job.stdout


def test_checkpoints_are_megatron_lm_layout_and_nothing_partial_is_left(dropout_run):
    run, _ = dropout_run
    ckpt = run / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "iter_0000003",
        "iter_0000006",
        "latest_checkpointed_iteration.txt",
    ]
    assert (ckpt / "iter_0000003" / "metadata.json").exists() and (ckpt / "iter_0000003" / "common.pt").exists()


def test_wandb_gets_megatron_lm_keys_per_iteration_and_evaluation(dropout_run):
    from wandb_offline import history

    run, _ = dropout_run
    rows = history(run / "wb")  # WANDB_MODE=offline (tests/distributed.py)
    train = {row["_step"]: row for row in rows if "lm loss" in row}
    assert sorted(train) == [1, 2, 3, 4, 5, 6]
    assert {s: row["lm loss"] for s, row in train.items()} == pytest.approx(train_losses(run), rel=1e-6)
    assert {"learning-rate", "decoupled-learning-rate", "grad-norm", "loss-scale", "batch-size"} <= set(train[6])
    # wandb merges what is logged at one step: the evaluation at 6 after training is the one kept
    logged = {row["_step"]: row["lm loss validation"] for row in rows if "lm loss validation" in row}
    assert logged == pytest.approx(dict(validation_losses(run)))
    assert any("lm loss test" in row for row in rows)


def test_decoupled_lr_runs_the_same_schedule_on_the_embedding_and_output_layer(dropout_run):
    _, job = dropout_run
    lines = [line for line in job.stdout.splitlines() if "] iteration " in line]
    pairs = [
        (
            float(re.search(r" learning rate: ([\d.E+-]+)", line).group(1)),
            float(re.search(r"decoupled learning rate: ([\d.E+-]+)", line).group(1)),
        )
        for line in lines
    ]
    assert len(pairs) == 6
    assert pairs[0] == pytest.approx((5e-4, 2.5e-3))  # linear warmup over 2 iterations from 0: ratio 5
    assert pairs[-1] == pytest.approx((1e-4, 5e-4))  # the decay's end: each group's minimum
    for lr, decoupled in pairs[1:-1]:  # cosine between: the same phase for both
        assert (decoupled - 5e-4) / (5e-3 - 5e-4) == pytest.approx((lr - 1e-4) / (1e-3 - 1e-4), rel=1e-5)


def test_tensorboard_has_megatron_tag_names(dropout_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = dropout_run
    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "lm loss",
        "learning-rate",
        "grad-norm",
        "loss-scale",
        "batch-size",
        "lm loss validation",
        "lm loss test",
        "decoupled-learning-rate",
    } <= tags
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2, 3, 4, 5, 6]


def test_profile_writes_a_chrome_trace_of_the_asked_iterations(dropout_run):
    run, job = dropout_run
    trace = json.loads((run / "logs" / "profile" / "rank00000.json").read_text())
    assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])
    assert "profiler trace of iterations 2..2" in job.stdout


def test_resume_reproduces_the_uninterrupted_run_exactly(dropout_run, resumed_run):
    """Model, optimizer (distributed, torch AdamW), scheduler, dropout RNG and data position."""
    continuous, _ = dropout_run
    resumed, job = resumed_run
    expected = {i: v for i, v in train_losses(continuous).items() if i > 3}
    assert train_losses(resumed) == expected
    assert validation_losses(resumed) == [v for v in validation_losses(continuous) if v[0] > 3]
    assert "successfully loaded checkpoint" in job.stdout


def test_a_save_killed_midway_never_shadows_the_last_complete_checkpoint(resumed_run):
    run, job = resumed_run
    root = run / "ckpt"
    assert "at iteration 3" in job.stdout  # the tracker, not the half-written directory, decides
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_0000003",
        "iter_0000006",
        "latest_checkpointed_iteration.txt",
    ]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "6"


def test_tp1_checkpoint_trains_on_under_tp2_dp2_with_sp_and_distributed_optimizer(reference_run, tp2_dp2_run):
    run, _ = tp2_dp2_run
    expected = {i: v for i, v in train_losses(reference_run).items() if i > 3}
    assert_close(train_losses(run), expected, rel=1e-4)


def test_tp1_checkpoint_trains_on_under_tp2_pp2_interleaved(reference_run, tp2_pp2_vpp2_run):
    """PP=2 with virtual stages: megatron-core's batched p2p would swap activations and gradients."""
    run, job = tp2_pp2_vpp2_run
    expected = {i: v for i, v in train_losses(reference_run).items() if i > 3}
    assert_close(train_losses(run), expected, rel=1e-4)
    assert "resharding" in job.stdout


def test_layout_record_is_what_parallel_state_built(tp2_pp2_vpp2_run):
    run, _ = tp2_pp2_vpp2_run
    layout = json.loads((run / "logs" / "layout.json").read_text())
    assert layout["world_size"] == 4
    assert layout["groups"]["tp"] == [[0, 1], [2, 3]]
    assert layout["groups"]["pp"] == [[0, 2], [1, 3]]
    assert [(r["tp_rank"], r["pp_rank"]) for r in layout["ranks"]] == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_timers_are_written_per_rank_and_iteration(tp2_pp2_vpp2_run):
    run, _ = tp2_pp2_vpp2_run
    files = sorted((run / "logs" / "timers").glob("rank*.jsonl"))
    assert [f.name for f in files] == [f"rank{r:05d}.jsonl" for r in range(4)]
    for path in files:
        records = [json.loads(line) for line in path.read_text().splitlines()]
        assert [r["iteration"] for r in records] == [4, 5, 6]
        for record in records:
            assert 0 < record["forward_backward_s"] <= record["iteration_s"]
            assert record["pp_wait_s"] > 0  # interleaved pipeline: every rank sends and receives
            assert record["optimizer_s"] > 0
            assert record["num_microbatches"] == 4


def test_llama_style_fp16_with_recompute_on_real_data_counts_skipped_iterations_as_megatron_lm(tmp_path):
    """The bundled corpus as a Megatron indexed dataset with its SentencePiece tokenizer; GQA, RoPE,
    SwiGLU, RMSNorm, untied embeddings, no biases, full recompute, fp16 loss scaling: the dynamic
    scale starts at 2**32 and overflows; each overflow skips the update, and after the first
    (hysteresis 2) the scale halves, as in Megatron-LM."""
    from megatron_npu.data import DEMO_TOKENIZER_MODEL, ensure_demo_dataset

    data = [
        "--data-path",
        ensure_demo_dataset(str(tmp_path / "data")),
        "--split",
        "98,2,0",
        "--tokenizer-type",
        "GPTSentencePieceTokenizer",
        "--tokenizer-model",
        DEMO_TOKENIZER_MODEL,
    ]
    job = pretrain(
        tmp_path,
        *data,
        "--train-iters",
        "3",
        "--fp16",
        "--eval-iters",
        "0",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--position-embedding-type",
        "rope",
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--untie-embeddings-and-output-weights",
        "--disable-bias-linear",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
        mock_data=False,
    ).check()
    lines = [line for line in job.stdout.splitlines() if "] iteration " in line]
    scales = [float(re.search(r"loss scale: ([\d.]+)", line).group(1)) for line in lines]
    skipped = [int(re.search(r"number of skipped iterations: +(\d+)", line).group(1)) for line in lines]
    assert scales == [2.0**32, 2.0**31, 2.0**30] and skipped == [1, 2, 3]
    assert all("grad norm" not in line for line in lines)  # no update, no norm: Megatron-LM prints none


def test_a_changed_lr_schedule_on_resume_is_one_message_naming_the_flags(dropout_run, tmp_path):
    source, _ = dropout_run
    load = checkpoint_at(source / "ckpt", 3, tmp_path / "ckpt")
    job = pretrain(tmp_path, "--train-iters", "8", "--use-distributed-optimizer", "--load", str(load))
    assert job.returncode != 0
    assert job.stderr.count("megatron-npu: error:") == 1
    assert "--use-checkpoint-opt-param-scheduler" in job.stderr and "--override-opt-param-scheduler" in job.stderr
    assert "[rank0]: Traceback" not in job.stderr
