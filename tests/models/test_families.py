"""The model families teams pretrain today, scaled down, exact across layouts in pretrain_gpt.py.

Each family (its architecture flags as Megatron-LM core_v0.16.1 recipes give them; a few layers, a
small hidden size, fp32, no dropout) is two torchrun jobs:
  one rank   trains 3 iterations and saves at 1, 2, 3
  layout     loads the one-rank save of iteration 1 under another layout (TP2 x PP2, uneven stages
             for the DeepSeek-V3-style model; EP2 x TP2 with sequence parallelism for the MoE ones, gpt-oss's
             at expert TP 1, which its expert biases need; the distributed optimizer) and trains iterations
             2 and 3
The layout's lm loss (and MTP / MoE aux losses) at 2 and 3 equal the one-rank run's (rel 1e-5): a
save at one layout resumes exactly at another. Layouts are compared from a common checkpoint:
megatron-core draws each TP shard and each EP rank's experts from its own RNG stream.
"""

from __future__ import annotations

import pytest
from pretrain_runs import NO_DROPOUT, checkpoint_at, metrics, pretrain

# the distributed optimizer in both runs: its optimizer state is saved in its own layout
COMMON = [
    *NO_DROPOUT,
    "--train-iters",
    "3",
    "--eval-interval",
    "1000",
    "--use-distributed-optimizer",
]
NO_BIAS = ["--disable-bias-linear"]
ROPE = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights"]
MOE_LAYOUT = [
    "--tensor-model-parallel-size",
    "2",
    "--sequence-parallel",
    "--expert-model-parallel-size",
    "2",
    "--moe-token-dispatcher-type",
    "alltoall",
]
DENSE_LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
GQA = ["--group-query-attention", "--num-query-groups", "2"]
# the small MoE of Qwen3-MoE, gpt-oss and Mixtral: 4 experts of ffn 32, top-2
EXPERTS = ["--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-router-topk", "2"]

FAMILIES = {
    # MLA with a query low rank and YaRN, a dense first layer, shared experts, a sigmoid router with
    # groups and expert bias, one MTP layer; 3 layers over PP2 as 1 + 2 (uneven stages)
    "deepseek_v3": (
        [
            *ROPE,
            *NO_BIAS,
            "--swiglu",
            "--num-layers",
            "3",
            "--multi-latent-attention",
            "--q-lora-rank",
            "32",
            "--kv-lora-rank",
            "16",
            "--qk-head-dim",
            "16",
            "--qk-pos-emb-head-dim",
            "8",
            "--v-head-dim",
            "16",
            "--qk-layernorm",
            "--rotary-scaling-factor",
            "40",
            "--mscale-all-dim",
            "1.0",
            "--num-experts",
            "8",
            "--moe-layer-freq",
            "[0]*1+[1]*2",
            "--moe-ffn-hidden-size",
            "32",
            "--moe-shared-expert-intermediate-size",
            "32",
            "--moe-router-score-function",
            "sigmoid",
            "--moe-router-enable-expert-bias",
            "--moe-router-num-groups",
            "4",
            "--moe-router-group-topk",
            "2",
            "--moe-router-topk",
            "2",
            "--moe-router-topk-scaling-factor",
            "2.5",
            "--moe-router-load-balancing-type",
            "seq_aux_loss",
            "--moe-aux-loss-coeff",
            "0.001",
            "--mtp-num-layers",
            "1",
            "--mtp-loss-scaling-factor",
            "0.1",
        ],
        [*DENSE_LAYOUT, "--sequence-parallel", "--decoder-first-pipeline-num-layers", "1"],
    ),
    "qwen3": (
        [*ROPE, *NO_BIAS, "--swiglu", "--qk-layernorm", *GQA],
        DENSE_LAYOUT,
    ),
    "qwen3_moe": (
        [
            *ROPE,
            *NO_BIAS,
            "--swiglu",
            "--qk-layernorm",
            *GQA,
            *EXPERTS,
            "--moe-aux-loss-coeff",
            "0.001",
        ],
        MOE_LAYOUT,
    ),
    "llama3": (
        [*ROPE, *NO_BIAS, "--swiglu", *GQA, "--use-rope-scaling"],
        DENSE_LAYOUT,
    ),
    # learnable softmax offsets (sinks), a sliding window every other layer, quick-GeGLU with its
    # offset and clamp, biases in every linear layer: attention, experts and router (Megatron-LM's
    # default --add-bias-linear, gpt-oss's configuration)
    "gpt_oss": (
        [
            *ROPE,
            *GQA,
            "--kv-channels",
            "16",
            "--quick-geglu",
            "--glu-linear-offset",
            "1.0",
            "--activation-func-clamp-value",
            "7.0",
            "--softmax-type",
            "learnable",
            "--window-size",
            "8,0",
            "--window-attn-skip-freq",
            "2",
            *EXPERTS,
            "--moe-aux-loss-coeff",
            "0.01",
        ],
        # expert TP 1: megatron-core splits no expert bias; so the experts are data-parallel over the TP pair, and
        # their fc2 biases' gradient was summed over TP once more under SP (rel 2.6e-4) before
        # megatron_npu/patches/moe_expert_bias.py
        [*MOE_LAYOUT, "--expert-tensor-parallel-size", "1"],
    ),
    "mixtral": (
        [
            *ROPE,
            *NO_BIAS,
            "--swiglu",
            *GQA,
            *EXPERTS,
            "--moe-aux-loss-coeff",
            "0.01",
        ],
        MOE_LAYOUT,
    ),
}

#: the losses each iteration reports besides lm loss (metrics.jsonl names)
LOSS_NAMES = ("lm_loss", "mtp_1 loss", "load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss")


def _losses(run) -> dict[int, dict[str, float]]:
    return {m["iteration"]: {k: m[k] for k in LOSS_NAMES if k in m} for m in metrics(run) if "lm_loss" in m}


@pytest.mark.launch
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_resumes_the_one_rank_save_exactly_under_another_layout(family, tmp_path):
    flags, layout = FAMILIES[family]
    one = tmp_path / "one"
    pretrain(one, *COMMON, *flags, "--save", str(one / "ckpt"), "--save-interval", "1").check()
    other = tmp_path / "layout"
    load = checkpoint_at(one / "ckpt", 1, other / "load")
    job = pretrain(other, *COMMON, *flags, *layout, "--load", str(load), nproc=4).check()
    expected = {i: v for i, v in _losses(one).items() if i > 1}
    got = _losses(other)
    assert sorted(got) == [2, 3] and all(set(got[i]) == set(expected[i]) for i in got), (got, expected)
    if family == "deepseek_v3":
        assert "mtp_1 loss" in got[2] and "mtp_1 loss:" in job.stdout  # Megatron-LM's iteration line
    for i in got:
        assert got[i] == pytest.approx(expected[i], rel=1e-5), (i, got[i], expected[i])
