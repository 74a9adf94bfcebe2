"""`megatron-npu plan` with pretrain_gpt.py's flags, and `plan --search` on LLaMA-2-shaped models (no torchrun)."""

from __future__ import annotations

import json

import pytest

from megatron_npu.plan import cli as plan_cli
from megatron_npu.plan import search
from megatron_npu.training.arguments import parse_args

COMMON = (
    "--seq-length 4096 --max-position-embeddings 4096 --swiglu --normalization RMSNorm --position-embedding-type rope "
    "--disable-bias-linear --untie-embeddings-and-output-weights --bf16 --vocab-size 32000 --micro-batch-size 1 "
    "--global-batch-size 1024"
).split()
LLAMA2 = {  # Hugging Face's meta-llama/Llama-2-{7,13,70}b configs as pretrain_gpt.py flags
    "7b": "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008".split(),
    "13b": "--num-layers 40 --hidden-size 5120 --num-attention-heads 40 --ffn-hidden-size 13824".split(),
    "70b": (
        "--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --group-query-attention --num-query-groups 8 "
        "--ffn-hidden-size 28672"
    ).split(),
}
# (model, nodes): a fit is expected (True), a refusal (False); 70B's weights, grads and Adam state need
# about 1.1 TB: more than 8 cards of 64 GB hold
EXPECT = {("7b", 1): True, ("13b", 2): True, ("70b", 16): True, ("70b", 1): False}


def run_search(capsys, model: str, nodes: int) -> tuple[int, dict | None, str]:
    argv = ["--search", "--nnodes", str(nodes), "--nproc-per-node", "8", *LLAMA2[model], *COMMON, "--json"]
    rc = plan_cli.main(argv + ["--top", "3"])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else None), out.err


@pytest.mark.parametrize("model,nodes", [("7b", 1), ("70b", 1)])
def test_search_prints_layouts_that_fit_and_pass_the_trainers_validation(capsys, model, nodes):
    rc, data, err = run_search(capsys, model, nodes)
    expected = EXPECT.get((model, nodes))
    if rc != 0:
        assert expected is not True, err
        assert rc == 3 and err.count("\n") == 1 and err.startswith("plan: no layout fits:") and "GB per card" in err
        return
    assert expected is not False and data["layouts"]
    limit = 64e9 * (1 - search.HEADROOM)
    steps = [row["predicted_step_s"] for row in data["layouts"]]
    # fastest first, but step times within 1% are ordered by memory headroom
    assert all(steps[i] <= steps[j] * (1 + search.TIE) for i in range(len(steps)) for j in range(i, len(steps)))
    for row in data["layouts"]:
        assert row["max_memory_bytes"] <= limit
        assert row["tp"] in (1, 2, 4, 8) and row["rank_map"]["groups_crossing_nodes"].count("tp") == 0
        stages = {m["pp_rank"]: m for m in row["memory"]}
        # the ends, and a middle stage of each kind (uneven ends make the middle ones a kind of their own)
        assert {0, row["pp"] - 1} <= set(stages) <= set(range(row["pp"]))
        if row["pp"] > 1:  # the first stage holds the embedding, the last the output layer and logits
            assert stages[0]["saved_by_type"].get("embedding") and stages[row["pp"] - 1]["saved_by_type"].get("output")
        # the printed flags are pretrain_gpt.py's, accepted by its validation for this world size
        args = parse_args(
            [*row["flags"], "--mock-data", "--train-iters", "1", "--lr", "1e-4"],
            world_size=nodes * 8,
            check_paths=False,
            check_target=False,
        )
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (row["tp"], row["pp"])
        assert args.parallel.dp == row["dp"] and args.sequence_parallel == (row["tp"] > 1)
        assert args.use_flash_attn and args.micro_batch_size == row["micro_batch_size"]
        assert args.context_parallel_size == row["cp"]
        assert 0 < row["mfu"] < 1 and row["tokens_per_s_per_npu"] > 0
    rows = [
        (r["tp"], r["pp"], r["vpp"], r["dp"], r["cp"], r["micro_batch_size"], r["recompute"]) for r in data["layouts"]
    ]
    assert len(rows) == len(set(rows))  # identical rows folded


def test_search_table_and_hf_config(tmp_path, capsys):
    """--hf-config gives the same model flags as the trainer's spelling; the table names the assumptions."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 4096,
                "intermediate_size": 11008,
                "num_attention_heads": 32,
                "num_hidden_layers": 32,
                "num_key_value_heads": 32,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-5,
                "vocab_size": 32000,
                "hidden_act": "silu",
                "rope_theta": 10000.0,
                "torch_dtype": "bfloat16",
                "tie_word_embeddings": False,
            }
        )
    )
    shape = "--seq-length 4096 --micro-batch-size 1 --global-batch-size 1024".split()
    assert (
        plan_cli.main(["--search", "--nnodes", "1", "--nproc-per-node", "8", "--hf-config", str(tmp_path), *shape]) == 0
    )
    table = capsys.readouterr().out
    assert "fit 64 GB less 10% headroom = 57.6 GB per 910B" in table and "(GB = 1e9 bytes)" in table
    assert "ASSUMES 62% (matmuls) / 45% (flash attention) of 354 TFLOP/s" in table and "GiB" not in table
    assert "1. TP " in table and "memory per card (GB): stage 0 " in table and "flags: --num-layers 32" in table
    assert "tokens/s per NPU, MFU " in table and "--use-flash-attn" in table
    assert max(len(line) for line in table.splitlines() if not line.startswith(("1", "2", "3", "4", "5"))) <= 130
    rc, data, _ = run_search(capsys, "7b", 1)
    first = table.split("\n1. ")[1].split(":")[0]
    assert first.startswith(f"TP {data['layouts'][0]['tp']} x PP {data['layouts'][0]['pp']}")


def test_plan_takes_the_trainers_flags_and_the_short_spellings(capsys):
    shape = (
        "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
        "--global-batch-size 8 --vocab-size 1000"
    ).split()
    launch = ["--nnodes", "1", "--nproc-per-node", "4", "--json"]
    assert (
        plan_cli.main([*launch, *shape, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])
        == 0
    )
    trainer = json.loads(capsys.readouterr().out)
    assert plan_cli.main([*launch, *shape, "--tp", "2", "--pp", "2", "--dtype", "fp32"]) == 0
    short = json.loads(capsys.readouterr().out)
    assert trainer["ranks"] == short["ranks"] and trainer["memory"] == short["memory"]
    assert [m["pp_rank"] for m in trainer["memory"]] == [0, 1]
    assert trainer["memory"][1]["saved_by_type"]["output"] > 0 and "output" not in trainer["memory"][0]["saved_by_type"]
    # the trainer's validation names its own flag
    assert plan_cli.main([*launch, *shape, "--tensor-model-parallel-size", "3"]) == 2
    assert "megatron-npu plan: error:" in capsys.readouterr().err


def test_in_flight_micro_batches_follow_megatron_core_schedules():
    assert search.__name__  # the module imports without torch's trainer
    from megatron_npu.layout.memory import in_flight

    assert [in_flight(4, 1, r, 8)[0] for r in range(4)] == [{0: 4}, {0: 3}, {0: 2}, {0: 1}]
    assert in_flight(4, 1, 0, 2)[0] == {0: 2}  # fewer micro-batches than stages
    # interleaved, PP 2 x VPP 2, 4 micro-batches: stage 0 warms up 2 + 2 forwards, then one more
    assert in_flight(2, 2, 0, 4)[0] == {0: 3, 1: 2} and in_flight(2, 2, 1, 4)[0] == {0: 2, 1: 1}


def test_bf16_overrides_the_hf_configs_dtype_and_plain_plan_predicts_throughput(tmp_path, capsys):
    """issue 39: a float16 config.json with --bf16 was refused ('mutually exclusive'); plain plan
    prints GB (1e9) and the step-time model's tokens/s per NPU and MFU."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "vocab_size": 1000,
        "hidden_act": "silu",
        "torch_dtype": "float16",
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    launch = ["--nnodes", "1", "--nproc-per-node", "2", "--hf-config", str(tmp_path), "--seq-length", "512"]
    launch += ["--global-batch-size", "8"]  # no --micro-batch-size: the plan takes 1
    assert plan_cli.main([*launch, "--bf16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["params_dtype"] == "bf16" and data["model"]["micro_batch_size"] == 1
    assert 0 < data["predicted"]["mfu"] < 1
    assert plan_cli.main([*launch, "--json"]) == 0  # the config's own dtype without an override
    assert json.loads(capsys.readouterr().out)["model"]["params_dtype"] == "fp16"
    assert plan_cli.main([*launch, "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "GB = 1e9 bytes" in out and "GiB" not in out and "tokens/s per NPU, MFU" in out and "ASSUMES" in out


def test_ranking_breaks_ties_by_headroom_and_folds_identical_rows():
    from megatron_npu.layout.memory import RankMemory
    from megatron_npu.layout.step_time import StepTime

    def row(step: float, peak: int, recompute: str = "none", tp: int = 1) -> search.Candidate:
        c = search.Candidate(tp, 1, None, 1, recompute, True)
        c.memory = [RankMemory(0, 0, peak, 0, 0, {}, {}, {}, 0)]
        c.time = StepTime(step, 0.0, 0.0, 0.0, 1, 1, 1.0)
        return c

    fast_full, near_roomy, slow = row(10.0, 50 * 10**9), row(10.05, 30 * 10**9, tp=2), row(11.0, 10**9, tp=4)
    assert search.rank([slow, fast_full, near_roomy]) == [near_roomy, fast_full, slow]
    twin = row(10.0, 50 * 10**9, recompute="selective")
    assert search._fold([fast_full, twin]) == [fast_full]
    flags = ["--num-layers", "32", *["--sequence-parallel", "--use-distributed-optimizer"] * 8, "--bf16"]
    wrapped = search.wrap_flags(flags)
    assert all(len(line) <= search.FLAG_WIDTH for line in wrapped.splitlines()) and "--num-layers 32" in wrapped


def test_search_fits_by_every_kind_of_stage_not_only_the_ends():
    """Dense-first MoE (DeepSeek-V3's pattern) with a lighter first stage: a middle stage holds the most, and
    the search's fit sees it (it had looked at the first and last stage only)."""
    from megatron_npu.layout.memory import MemorySettings, predict_all
    from megatron_npu.layout.model_spec import ModelSpec
    from megatron_npu.layout.parallel_dims import ParallelDims

    model = ModelSpec(
        num_layers=10,
        hidden_size=256,
        num_attention_heads=8,
        seq_length=256,
        micro_batch_size=1,
        global_batch_size=16,
        vocab_size=1000,
        num_experts=8,
        moe_layer_freq=[0] + [1] * 9,
        params_dtype="bf16",
    )
    dims = ParallelDims(4, pp=4, num_layers=10, num_experts=8, first_stage_layers=1, last_stage_layers=3)
    st = MemorySettings(attention_dropout=0, hidden_dropout=0)
    every = predict_all(model, dims, st)
    chosen = search._stage_memory(model, dims, st)
    largest = max(every, key=lambda m: m.total_bytes)
    assert 0 < largest.pp_rank < 3  # a middle stage: the ends alone would under-state the layout
    assert max(m.total_bytes for m in chosen) == largest.total_bytes
    assert {m.pp_rank for m in chosen} == {0, 1, 3}  # stage 2 is stage 1's kind with fewer in flight
