"""Mixture of Experts with expert parallelism: pretrain_gpt.py on megatron-core's MoE layers.

A small MoE GPT (8 experts, top-2, dropless; layers 1, 2 and 4 MoE, layer 3 dense), 6 iterations.
Eight launches:
  ep1           1 rank, allgather dispatcher, TensorBoard; saves at 2, 4, 6
  ep2           EP2 x DP2 (2 ranks), alltoall dispatcher, from ep1's iteration 2; saves at 4, 6;
                bytes per process group
  ep2_tp2       EP2 x TP2 x sequence parallel (4 ranks, expert TP 2) from ep1's iteration 2
  ep1_from_ep2  1 rank from ep2's iteration 4 (each rank's four experts gathered into eight)
  ep4_from_ep2  EP4 x expert TP1 folded over TP2 x DP2 (4 ranks) from ep2's iteration 4
  ep2_resumed   EP2 resuming ep2's iteration 4: bit-exact
  features x2   shared experts, seq aux loss, aux-loss-free bias, sigmoid scores, z-loss, capacity
                with padding and dropping, --moe-grouped-gemm, the distributed optimizer: 1 rank (saves
                at 2), then EP2 x PP2 x DP2 (4 ranks) from it
Layouts are compared from a common checkpoint: megatron-core initialises each EP rank's experts
from its own expert-parallel RNG seed (as each TP shard from its own), so from scratch EP2 is a
different (equally valid) draw; tests/test_pretrain_gpt.py does the same for TP.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from pretrain_runs import NO_DROPOUT, checkpoint_at, metrics, pretrain, train_losses

from megatron_npu.layout.moe import moe_layer_pattern
from megatron_npu.layout.parallel_dims import TRAINER_FLAGS, LayoutError, ParallelDims
from megatron_npu.layout.planner import ModelSpec, expert_all_to_all_bytes, plan
from megatron_npu.layout.rankmap import build_rank_map
from megatron_npu.training import arguments
from megatron_npu.training.arguments import ConfigError
from megatron_npu.training.moe_args import moe_freq_type

MOE = [
    "--train-iters",
    "6",
    *NO_DROPOUT,
    "--disable-bias-linear",
    "--num-experts",
    "8",
    "--moe-router-topk",
    "2",
    "--moe-aux-loss-coeff",
    "0.01",
    "--moe-layer-freq",
    "[1,1,0,1]",
]
SAVE_AT_2 = ["--save-interval", "2"]
NO_BIAS = ["--disable-bias-linear"]
E4 = ["--num-experts", "4", *NO_BIAS]
SINKHORN = ["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0"]
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
DIST_OPT = ["--use-distributed-optimizer"]
PP2 = ["--pipeline-model-parallel-size", "2"]
EP2 = ["--expert-model-parallel-size", "2", *ALLTOALL]
FEATURES = [
    "--moe-shared-expert-intermediate-size",
    "64",
    "--moe-ffn-hidden-size",
    "96",
    "--moe-router-load-balancing-type",
    "seq_aux_loss",
    "--moe-router-enable-expert-bias",
    "--moe-router-score-function",
    "sigmoid",
    "--moe-z-loss-coeff",
    "0.001",
    "--moe-expert-capacity-factor",
    "1.0",
    "--moe-token-drop-policy",
    "probs",
    "--moe-pad-expert-input-to-capacity",
    "--moe-grouped-gemm",
]
MOE_LINE = re.compile(r" lm loss: \d\.\d{6}E[-+]\d\d \| load_balancing_loss: \d\.\d{6}E[-+]\d\d \| loss scale:")


def _run(tmp_path_factory, name: str, *flags: str, nproc: int = 1, load_from=None, save=False, tensorboard=False):
    """``load_from``: (run, iteration) of an earlier run's checkpoint."""
    run = tmp_path_factory.mktemp(name)
    extra: list[str] = ["--tensorboard-dir", str(run / "tb")] if tensorboard else []
    if load_from is not None:
        source, iteration = load_from
        extra += ["--load", str(checkpoint_at(source / "ckpt", iteration, run / "load"))]
    if save:
        extra += ["--save", str(run / "ckpt"), *SAVE_AT_2]
    job = pretrain(run, *MOE, *extra, *flags, nproc=nproc).check()
    return run, job


@pytest.fixture(scope="module")
def ep1(tmp_path_factory):
    return _run(tmp_path_factory, "ep1", save=True, tensorboard=True)


@pytest.fixture(scope="module")
def ep2(ep1, tmp_path_factory):
    return _run(tmp_path_factory, "ep2", *EP2, "--timing-log-level", "2", nproc=2, save=True, load_from=(ep1[0], 2))


def _after(run, iteration: int) -> dict[int, float]:
    return {i: v for i, v in train_losses(run).items() if i > iteration}


def _moe_losses(run) -> dict[int, float]:
    return {m["iteration"]: m["load_balancing_loss"] for m in metrics(run) if "load_balancing_loss" in m}


# ---- one launch each ---------------------------------------------------------------------------
@pytest.mark.launch
def test_moe_iteration_line_and_tensorboard_carry_megatron_lms_aux_loss(ep1):
    run, job = ep1
    lines = [line for line in job.stdout.splitlines() if "elapsed time per iteration" in line]
    assert len(lines) == 6 and all(MOE_LINE.search(line) for line in lines)
    aux = _moe_losses(run)
    assert sorted(aux) == [1, 2, 3, 4, 5, 6] and all(0.5 < v < 2.0 for v in aux.values())  # ~1 when balanced
    assert "moe_ffn_hidden_size is not set" in job.stdout + job.stderr  # Megatron-LM's warning
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run / "tb"))
    tb.Reload()
    assert "load_balancing_loss" in tb.Tags()["scalars"]
    assert [e.value for e in tb.Scalars("load_balancing_loss")] == pytest.approx([aux[i] for i in range(1, 7)])


@pytest.mark.launch
def test_ep1_checkpoint_trains_on_under_ep2_dp2_with_the_alltoall_dispatcher(ep1, ep2):
    run, job = ep2
    assert train_losses(run) == pytest.approx(_after(ep1[0], 2), rel=1e-5)
    ep1_aux = {i: v for i, v in _moe_losses(ep1[0]).items() if i > 2}
    assert _moe_losses(run) == pytest.approx(ep1_aux, rel=1e-5)
    assert "resharding" in job.stdout


@pytest.mark.launch
def test_ep1_checkpoint_trains_on_under_ep2_x_tp2_with_sequence_parallel(ep1, tmp_path_factory):
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    run, _ = _run(tmp_path_factory, "ep2_tp2", *EP2, *tp2, nproc=4, load_from=(ep1[0], 2))
    assert train_losses(run) == pytest.approx(_after(ep1[0], 2), rel=1e-5)
    args = json.loads((run / "logs" / "args.json").read_text())
    assert (args["expert_model_parallel_size"], args["expert_tensor_parallel_size"]) == (2, 2)


@pytest.mark.launch
def test_ep2_checkpoint_loads_under_ep1(ep1, ep2, tmp_path_factory):
    run, _ = _run(tmp_path_factory, "ep1_from_ep2", load_from=(ep2[0], 4))
    assert train_losses(run) == pytest.approx(_after(ep2[0], 4), rel=1e-5)
    assert train_losses(run) == pytest.approx(_after(ep1[0], 4), rel=1e-5)


@pytest.mark.launch
def test_ep2_checkpoint_loads_under_ep4_folded_over_tp2(ep2, tmp_path_factory):
    """MoE parallel folding: attention TP2 x DP2, experts EP4 x expert TP1 on the same 4 ranks."""
    folded = ["--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1", *ALLTOALL]
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    run, _ = _run(tmp_path_factory, "ep4_from_ep2", *folded, *tp2, nproc=4, load_from=(ep2[0], 4))
    assert train_losses(run) == pytest.approx(_after(ep2[0], 4), rel=1e-5)


@pytest.mark.launch
def test_ep2_resume_reproduces_the_uninterrupted_run_exactly(ep2, tmp_path_factory):
    run, _ = _run(tmp_path_factory, "ep2_resumed", *EP2, nproc=2, load_from=(ep2[0], 4))
    assert train_losses(run) == _after(ep2[0], 4)
    assert _moe_losses(run) == {i: v for i, v in _moe_losses(ep2[0]).items() if i > 4}


@pytest.mark.launch
def test_planner_expert_all_to_all_bytes_are_the_bytes_measured(ep2):
    """Dropless top-2, TP1: each MoE layer's dispatch and combine send every local token-expert pair
    once, forward and backward; counted by torch.distributed's all_to_all_single on the EP group."""
    run, _ = ep2
    expected = expert_all_to_all_bytes(
        micro_batch_size=2,
        seq_length=32,
        hidden_size=64,
        topk=2,
        moe_layers=sum(moe_layer_pattern([1, 1, 0, 1], 4)),
        microbatches=2,  # 8 / (2 x DP 2)
        dtype_bytes=4,
    )
    assert expected == (4 * (2 * 32 * 2) * 64 * 4 + 2 * (2 * 32 * 2) * 4) * 3 * 2
    model = ModelSpec(4, 64, 4, 32, 2, 8, 128, add_bias_linear=False, params_dtype="fp32", num_experts=8)
    model.moe_layer_freq = [1, 1, 0, 1]
    comm_plan = plan(model, build_rank_map(world_size=2, ep=2, num_experts=8))
    per_rank = []
    for rank in (0, 1):
        timers = (run / "logs" / "timers" / f"rank{rank:05d}.jsonl").read_text().splitlines()
        measured = [json.loads(line)["comm"]["ep"]["bytes"] for line in timers]
        assert comm_plan.ranks[rank].by_label()["ep"]["bytes"] == expected
        per_rank.append(measured)
    # each rank's own figure follows the routing (what it receives); the EP group's sum does not
    assert [a + b for a, b in zip(*per_rank, strict=True)] == [2 * expected] * 4


@pytest.mark.launch
def test_capacity_dropping_and_the_other_router_options_agree_across_ep_and_pp(tmp_path_factory):
    """With a capacity factor each router caps the tokens per expert of the micro-batch it sees
    (megatron-core sizes the capacity from the router's own tokens), so layouts that give each
    router the same tokens (EP, DP, PP) drop the same ones; sequence parallelism (TP > 1) shows each
    router a slice of the sequence and drops differently, so TP layouts are not expected equal.
    Both runs use the distributed optimizer: its state saved by EP1's one optimizer loads into
    EP2's two (dense and expert), sharded over DP2, with the MoE layers on two pipeline stages."""
    single, _ = _run(tmp_path_factory, "features_ep1", *FEATURES, *ALLTOALL, *DIST_OPT, save=True)
    parallel, job = _run(
        tmp_path_factory, "features_ep2_pp2", *FEATURES, *EP2, *PP2, *DIST_OPT, nproc=4, load_from=(single, 2)
    )
    assert "resharding" in job.stdout
    assert train_losses(parallel) == pytest.approx(_after(single, 2), rel=1e-5)
    names = {k for m in metrics(parallel) for k in m if k.endswith("loss") and k != "lm_loss"}
    assert names == {"seq_load_balancing_loss", "z_loss"}  # only what was asked (see reporting.py)
    assert "seq_load_balancing_loss:" in job.stdout and " load_balancing_loss:" not in job.stdout


# ---- no launch ---------------------------------------------------------------------------------
def test_moe_flag_defaults_are_megatron_cores():
    from megatron.core.transformer import TransformerConfig

    # config.py copies every TransformerConfig field that has a flag of the same name (as Megatron-LM)
    defaults = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    args = vars(arguments.build_parser().parse_args([]))
    moe = [name for name in defaults if name in args and name.startswith(("moe_", "expert_"))]
    assert len(moe) >= 20, moe  # the family is read by reflection, not lost
    for name in moe:
        assert args[name] == defaults[name], name
    assert args["num_experts"] is None


def test_moe_layer_freq_reads_as_megatron_lm():
    assert moe_freq_type("2") == 2
    assert moe_freq_type("([1]*3+[0]*1)*2") == [1, 1, 1, 0, 1, 1, 1, 0]
    assert moe_layer_pattern(2, 4) == [True, False, True, False]
    with pytest.raises(Exception, match="only integers"):
        moe_freq_type("__import__('os')")


def _parse(*flags: str, world_size: int = 1):
    base = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32"]
    base += ["--micro-batch-size", "1", "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer"]
    base += ["--vocab-size", "128", "--lr", "1e-3"]
    return arguments.parse_args([*base, *flags], world_size=world_size, check_paths=False)


@pytest.mark.parametrize(
    "flags,world,message",
    [
        (["--num-experts", "6", "--expert-model-parallel-size", "4", *NO_BIAS], 4, r"--num-experts 6 is not divisible"),
        (
            [
                "--num-experts",
                "8",
                "--expert-model-parallel-size",
                "4",
                "--pipeline-model-parallel-size",
                "2",
                *NO_BIAS,
            ],
            4,
            r"world size 4 is not divisible by --expert-tensor-parallel-size 1 x --expert-model-parallel-size 4 x "
            r"--pipeline-model-parallel-size 2 = 8",
        ),
        (["--expert-model-parallel-size", "2"], 2, r"--expert-model-parallel-size 2 needs --num-experts"),
        (
            ["--num-experts", "4", "--tensor-model-parallel-size", "2"],
            2,
            r"biases needs --expert-tensor-parallel-size 1",
        ),
        (["--num-experts", "4", "--disable-bias-linear", "--moe-router-topk", "5"], 1, r"--moe-router-topk 5"),
        (["--num-experts", "4", "--disable-bias-linear", "--moe-layer-freq", "[1,0]"], 1, r"gives 2 layers"),
        (["--num-experts", "4", "--moe-token-dispatcher-type", "flex"], 1, r"DeepEP"),
        (["--num-experts", "4", "--moe-permute-fusion"], 1, r"--moe-permute-fusion is not supported"),
        # megatron-core 0.16.1's own MoE checks (TransformerConfig, MoELayer, router), made before any process group
        ([*E4, "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"], 1, r"needs one coefficient per type"),
        ([*E4, "--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0.1"], 1, r"coeff 0"),
        ([*E4, "--moe-shared-expert-intermediate-size", "0"], 1, r"intermediate-size must be positive"),
        ([*E4, "--moe-pad-expert-input-to-capacity"], 1, r"needs a --moe-expert-capacity-factor"),
        ([*E4, *SINKHORN, "--moe-expert-capacity-factor", "1"], 1, r"capacity-factor works with .* not sinkhorn"),
        ([*E4, "--moe-router-enable-expert-bias"], 1, r"needs --moe-router-score-function sigmoid"),
        ([*E4, "--moe-router-topk", "1"], 1, r"needs --moe-router-pre-softmax"),
        ([*E4, "--moe-router-group-topk", "2"], 1, r"needs --moe-router-num-groups"),
        (
            [*E4, "--moe-router-group-topk", "1", "--moe-router-num-groups", "3"],
            1,
            r"not divisible by --moe-router-num",
        ),
        (
            [*E4, "--moe-router-group-topk", "4", "--moe-router-num-groups", "2"],
            1,
            r"must be <= --moe-router-num-groups",
        ),
        (
            [*E4, "--moe-router-topk", "3", "--moe-router-group-topk", "1", "--moe-router-num-groups", "2"],
            1,
            r"--moe-router-topk 3 is more than the 2 experts",
        ),
        ([*E4, "--tensor-model-parallel-size", "2"], 2, r"needs --sequence-parallel"),
        ([*E4, "--recompute-granularity", "selective", "--recompute-modules", "moe_act"], 1, r"moe_act is not"),
    ],
)
def test_moe_layouts_and_flags_that_cannot_work_are_one_message(flags, world, message):
    with pytest.raises(ConfigError, match=message):
        _parse(*flags, world_size=world)


def test_moe_parallel_folding_layout():
    """megatron-core 0.16's expert grid is its own: EP need not divide the attention's DP."""
    dims = ParallelDims(4, tp=4, ep=4, etp=1, num_experts=8, flags=TRAINER_FLAGS)
    assert (dims.dp, dims.expert_tp, dims.expert_dp, dims.experts_per_rank) == (1, 1, 1, 2)
    assert ParallelDims(8, tp=2, ep=2, num_experts=8).expert_dp == 2  # expert TP defaults to TP
    with pytest.raises(LayoutError):
        ParallelDims(8, tp=2, ep=8, num_experts=8)
    args = _parse("--num-experts", "8", "--disable-bias-linear", "--expert-model-parallel-size", "2", world_size=2)
    assert args.expert_tensor_parallel_size == 1 and args.moe_ffn_hidden_size == args.ffn_hidden_size


def test_migrate_keeps_moe_flags_and_drops_the_cuda_only_fusions():
    from megatron_npu.migrate.bash import migrate_bash

    script = (
        "torchrun --nproc_per_node 8 pretrain_gpt.py --num-experts 8 --moe-router-topk 2 "
        "--expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-permute-fusion\n"
    )
    text = migrate_bash(script).text
    for kept in ("--num-experts 8", "--moe-router-topk 2", "--expert-model-parallel-size 4", "alltoall"):
        assert kept in text
    assert "--moe-grouped-gemm" in text and "--moe-permute-fusion" not in text


@pytest.mark.launch
def test_perf_report_shows_the_expert_all_to_all_next_to_the_plan(ep2):
    import contextlib
    import io

    from megatron_npu.perf import report as perf_report

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert perf_report.main([str(ep2[0] / "logs"), "--json"]) == 0
    checks = json.loads(out.getvalue())["checks"]
    dims = checks["traffic"]["dimensions"]
    ep = dims["ep"]
    assert ep["dimension"] == "expert all-to-all (EP)" and ep["planned_bytes"] == ep["measured_bytes"] > 0
    assert 0 < checks["communication"]["expert_all_to_all_s"]
    # every process group the EP2 x DP2 step used, planned byte for byte: the experts' own gradient
    # reduction (edp), the dispatcher's token counts (tp_ep), the expert optimizer's grad norm
    # (expert_mp), the aux loss tracker's reduces (pp, tp_cp, dp), beside the dense ones
    moe_groups = {"ep", "edp", "tp_ep", "expert_mp", "tp_cp"}
    assert moe_groups | {"tp", "pp", "dp", "dp_cp", "mp"} == set(dims)
    for label, d in dims.items():
        assert d["planned_bytes"] == pytest.approx(d["measured_bytes"]) and d["measured_bytes"] > 0, label


# ---- --moe-grouped-gemm: the grouped experts against megatron-core's sequential ones (no launch) ---------
@pytest.mark.parametrize("activation", ["gelu", "swiglu", "device_swiglu"])
def test_grouped_experts_equal_megatron_cores_sequential_experts_forward_and_backward(model_parallel, activation):
    import torch
    import torch.nn.functional as F  # noqa: N812
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron_npu.ops.grouped_gemm import GroupedSequentialMLP
    from megatron_npu.ops.spec_provider import DeviceActivation

    gated = activation != "gelu"
    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_moe_experts=4,
        moe_ffn_hidden_size=48,
        add_bias_linear=False,
        gated_linear_unit=gated,
        activation_func=F.silu if gated else F.gelu,
        use_te_activation_func=activation == "device_swiglu",  # the spec'd SwiGLU module (ops/spec_provider.py)
    )
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    submodules.activation_func = DeviceActivation if config.use_te_activation_func else None
    groups = get_default_pg_collection()
    sequential, grouped = (cls(4, config, submodules, groups) for cls in (SequentialMLP, GroupedSequentialMLP))
    grouped.load_state_dict(sequential.state_dict())
    generator = torch.Generator().manual_seed(0)
    tokens_per_expert = torch.tensor([5, 0, 9, 3])  # an expert without tokens, as routing gives
    hidden = torch.randn(17, 32, generator=generator)
    probs = torch.rand(17, generator=generator)
    outputs = []
    for experts in (sequential, grouped):
        x, p = hidden.clone().requires_grad_(), probs.clone().requires_grad_()
        out, bias = experts(x, tokens_per_expert, p)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads = [param.grad for param in experts.parameters()]
        outputs.append((out, bias, x.grad, p.grad, grads))
    (out_s, bias_s, dx_s, dp_s, dw_s), (out_g, bias_g, dx_g, dp_g, dw_g) = outputs
    assert bias_s is bias_g is None and len(dw_g) == 8
    torch.testing.assert_close(out_g, out_s, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx_g, dx_s, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dp_g, dp_s, rtol=1e-6, atol=1e-6)
    for got, expected in zip(dw_g, dw_s, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_grouped_matmul_runs_the_accelerators_kernel_and_the_npu_backward_matches_autograd():
    """The device kernel is used where the accelerator has one; the npu kernel's hand-written backward
    (torch_npu's grouped matmul has none) is checked on a stand-in for the op that follows its
    documented semantics (group_type 0: row groups, 2: groups along K, split_item 2/3: one tensor)."""
    import torch

    from megatron_npu.accelerator import set_accelerator
    from megatron_npu.accelerator.cpu import CpuAccelerator
    from megatron_npu.accelerator.npu import NpuAccelerator
    from megatron_npu.ops.grouped_gemm import grouped_matmul

    calls: list[dict] = []

    def npu_grouped_matmul(x, weight, *, group_list, split_item, group_type, group_list_type):
        calls.append({"split_item": split_item, "group_type": group_type, "group_list_type": group_list_type})
        counts = group_list.tolist()
        if group_type == 0:  # x [m, k] rows in groups, weight[i] [k, n]
            parts = torch.split(x[0], counts)
            return [torch.cat([a @ w for a, w in zip(parts, weight, strict=True)])]
        xt, dy = x[0], weight[0]  # group_type 2: xt [k, m], dy [m, n], the m axis in groups
        return [torch.stack([a @ b for a, b in zip(xt.split(counts, 1), dy.split(counts), strict=True)])]

    npu = object.__new__(NpuAccelerator)
    npu._torch_npu = type("FakeTorchNpu", (), {"npu_grouped_matmul": staticmethod(npu_grouped_matmul)})()

    class WithKernel(CpuAccelerator):
        def fused_kernel(self, key: str):
            return npu.fused_kernel(key) if key == "grouped_matmul" else None

    generator = torch.Generator().manual_seed(1)
    counts = [3, 0, 4]
    x = torch.randn(7, 5, generator=generator)
    weights = [torch.randn(6, 5, generator=generator) for _ in counts]
    results = []
    for accelerator in (CpuAccelerator(), WithKernel()):
        set_accelerator(accelerator)
        try:
            xs, ws = x.clone().requires_grad_(), [w.clone().requires_grad_() for w in weights]
            y = grouped_matmul(xs, ws, counts)
            (y * torch.arange(y.numel()).view_as(y)).sum().backward()
        finally:
            set_accelerator(None)
        results.append((y, xs.grad, [w.grad for w in ws]))
    assert [c["group_type"] for c in calls] == [0, 0, 2]  # forward, dx, dw
    assert {(c["split_item"], c["group_list_type"]) for c in calls} == {(2, 1), (3, 1)}
    (y_cpu, dx_cpu, dw_cpu), (y_npu, dx_npu, dw_npu) = results
    torch.testing.assert_close(y_npu, y_cpu)
    torch.testing.assert_close(dx_npu, dx_cpu)
    for got, expected in zip(dw_npu, dw_cpu, strict=True):
        torch.testing.assert_close(got, expected)


def test_distributed_optimizer_state_saved_under_ep2_adapts_to_ep1s_single_optimizer():
    """The reverse of the features launch (EP1 -> EP2 x PP2): EP2's two distributed optimizers saved
    their groups as common state; EP1's one optimizer takes its own groups with the saved step and
    keeps the tensors dist_checkpointing loaded for it."""
    from megatron_npu.training.moe_checkpoint import adapt_optimizer_state, saved_optimizer_count

    def groups(step: int, expert: bool) -> list[dict]:
        return [{"wd_mult": w, "lr_mult": 1.0, "is_expert_parallel": expert, "step": step} for w in (1.0, 0.0)]

    def saved(expert: bool) -> dict:
        return {"optimizer": {"param_groups": groups(4, expert)}, "param_state_sharding_type": "fully_reshardable"}

    class DistributedOptimizer:  # what adapt_optimizer_state reads of megatron-core's
        def state_dict(self) -> dict:
            return {"optimizer": {"param_groups": groups(0, False)}}

    common = {0: saved(False), 1: saved(True)}
    assert saved_optimizer_count(common) == 2
    tensors = {"exp_avg": "current shards"}
    adapted = adapt_optimizer_state({**common, "param_state": tensors}, DistributedOptimizer(), 2)
    assert adapted == {
        "optimizer": {"param_groups": groups(4, False)},
        "param_state_sharding_type": "fully_reshardable",
        "param_state": tensors,
    }
