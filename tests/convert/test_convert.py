"""`megatron-npu convert`: Hugging Face models to pretrain_gpt.py checkpoints and back.

No hub access: each family is a small randomly initialised transformers model saved with
save_pretrained (DeepSeek-V3's MTP layer, which transformers does not save, added as DeepSeek's
checkpoints hold it). Jobs: every model converted and exported back in one process; a 4-rank job
loading each checkpoint under TP1, TP2 x PP2 (PP2 x VPP2 for LLaMA, TP2 x EP2 with SP for the MoE
families) and comparing logits with transformers'; pretrain_gpt.py continuing a converted LLaMA
under TP2 x PP2, whose trained checkpoint is then exported and loaded by transformers; one
pretrain_gpt.py job per new family (first loss equal to transformers', a lr-0 save exported bit
for bit).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import ROOT, base_env, run, torchrun
from pretrain_runs import pretrain, train_losses, validation_losses

from megatron_npu.convert.hf_config import ConvertError, check_attention_window, layout_flags, model_spec, read_config
from megatron_npu.data.indexed_writer import IndexedDatasetWriter

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 128, 32
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, max_position_embeddings=64)
DEEPSEEK = dict(
    **COMMON,
    num_attention_heads=4,
    num_key_value_heads=4,
    moe_intermediate_size=32,
    n_routed_experts=8,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    routed_scaling_factor=2.5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# gpt-oss's published rope_scaling (openai/gpt-oss-20b and -120b config.json) with its rope_theta
GPT_OSS_YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "original_max_position_embeddings": 4096,
    "truncate": False,
}
CONFIGS = {
    # GQA, llama3 RoPE scaling, untied output layer
    "llama": lambda: transformers.LlamaConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, rope_parameters=LLAMA3_ROPE, rms_norm_eps=1e-5
    ),
    # QKV bias, tied embeddings, another RoPE base
    "qwen2": lambda: transformers.Qwen2Config(
        **COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-6,
    ),
    # head_dim apart from hidden/heads (--kv-channels)
    "mistral": lambda: transformers.MistralConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=None
    ),
    # learned positions, LayerNorm with biases, Conv1D weights, tied embeddings
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=4, n_head=4),
    # per-head q/k RMSNorm (--qk-layernorm), head_dim apart from hidden/heads, tied embeddings
    "qwen3": lambda: transformers.Qwen3Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True
    ),
    # experts with a dense layer between (--moe-layer-freq: each layer keyed on its own), top-k of a
    # softmax over all experts, not renormalised (--moe-router-pre-softmax)
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
    # every layer MoE (experts stacked over layers), renormalised top-2
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
    ),
    # MLA with q LoRA, a dense first layer, shared experts, sigmoid group-limited routing with the
    # score-correction bias and a scaling factor, YaRN
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **DEEPSEEK,
        q_lora_rank=32,
        n_group=2,
        topk_group=2,
        num_experts_per_tok=4,
        n_shared_experts=1,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e4,
            "factor": 4.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,  # megatron-core's MLA YaRN: fixed there
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
    ),
    # MLA without q LoRA, two shared experts, ungrouped top-2, plain RoPE
    "deepseek_v3-noq": lambda: transformers.DeepseekV3Config(
        **DEEPSEEK, q_lora_rank=None, n_group=1, topk_group=1, num_experts_per_tok=2, n_shared_experts=2
    ),
    # biases everywhere (router included), sinks, an 8-token window on every other layer (shorter than
    # the test's 16 tokens), clamped quick-GeGLU over interleaved gate/up experts stacked per layer, the
    # published YaRN (--position-embedding-type yarn)
    "gpt_oss": lambda: transformers.GptOssConfig(
        **{**COMMON, "intermediate_size": 32},
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        rope_parameters=GPT_OSS_YARN,
    ),
}
# q and k weights this many times larger: attention sharp enough that YaRN's frequencies show in a 32-token loss
# (with the published values' original_max_position_embeddings 131072 or truncate true it moves by rel 3.4e-3 and
# 8.4e-4 against 2e-6 and 6e-6 at the common scale)
SHARP_QK = {"gpt_oss": 4.0}
MOE = ["qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v3-noq", "gpt_oss"]
# Qwen2.5's vocabulary in small: 300 rows, a 200-token tokenizer. No power of two pads 200 to 300,
# so Megatron-LM's 128 x TP2 gives 256 rows: the 44 past them are cut and must come back.
CUT_VOCAB = lambda: transformers.Qwen2Config(  # noqa: E731
    **{**COMMON, "vocab_size": 300}, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6
)
# (TP, PP, VPP, EP) on 4 ranks; VPP for LLaMA, EP (TP2 x EP2 with SP) for the MoE families
LAYOUTS = [[1, 1, None, 1], [2, 2, None, 1], [1, 2, 2, 1], [2, 1, None, 2]]
# The training document; every sample pretrain_gpt.py reads is it plus its first token.
DOCUMENT = np.random.default_rng(1).integers(0, VOCAB - 8, SEQ).astype(np.uint16)
SAMPLE = torch.from_numpy(np.append(DOCUMENT, DOCUMENT[0]).astype(np.int64))


def _random_model(family: str, config: object = None) -> torch.nn.Module:
    """Every tensor random (norm scales around 1), so a swapped or mis-split tensor shows."""
    torch.manual_seed(hash(family) % 1000)
    config = config or CONFIGS[family]()
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_scale = p.dim() == 1 and ("norm" in name or "ln_" in name) and name.endswith("weight")
            p.copy_(1 + 0.1 * torch.randn_like(p) if is_scale else 0.08 * torch.randn_like(p))
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(SHARP_QK.get(family, 1.0))
        saved = model.state_dict()
        for name, b in model.named_buffers():
            if name in saved and b.is_floating_point():  # DeepSeek-V3's score-correction bias
                b.copy_(0.1 * torch.randn_like(b))
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("convert")
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    cases, sample_loss = {}, {}
    for family in CONFIGS:
        model = _random_model(family)
        model.save_pretrained(root / family / "hf")
        with torch.no_grad():
            logits = model(tokens).logits
            sample_loss[family] = _loss(model(SAMPLE[None, :-1]).logits[0])
        torch.save({"tokens": tokens, "logits": logits}, root / family / "expected.pt")
        cases[family] = {
            "hf": str(root / family / "hf"),
            "megatron": str(root / family / "megatron"),
            "back": str(root / family / "back"),
            "expected": str(root / family / "expected.pt"),
        }
        if family in MOE:  # converted for (and its printed flags those of) TP2 x EP2 with SP
            cases[family]["convert"] = ["--tp", "2", "--ep", "2"]
        if family == "gpt_oss":  # and PP2 too: TP2 x PP2 x EP2 with SP, experts at expert TP 1 (their biases)
            cases[family]["convert"] = ["--tp", "2", "--pp", "2", "--ep", "2"]
        if family == "llama":  # bf16 weights too (the model keeps its norm scales in fp32)
            model.to(torch.bfloat16).save_pretrained(root / "llama-bf16" / "hf")
            bf16 = {k: str(root / "llama-bf16" / k) for k in ("hf", "megatron", "back")}
        if family == "deepseek_v3":  # bf16 with the score-correction bias in fp32, as DeepSeek's own
            model.to(torch.bfloat16)
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.data = buffer.data.float()
            model.save_pretrained(root / "deepseek_v3-bf16" / "hf")
            ds_bf16 = {k: str(root / "deepseek_v3-bf16" / k) for k in ("hf", "megatron", "back")}
            ds_bf16["convert"] = ["--tp", "2", "--ep", "2"]
    _with_mtp_layer(root / "deepseek_v3" / "hf", root / "deepseek_v3-mtp" / "hf")
    mtp = {k: str(root / "deepseek_v3-mtp" / k) for k in ("hf", "megatron", "back")}
    mtp["convert"] = cases["deepseek_v3"]["convert"]
    sample_loss["deepseek_v3-mtp"] = sample_loss["deepseek_v3"]  # transformers runs no MTP layer
    _random_model("qwen2", CUT_VOCAB()).save_pretrained(root / "qwen2-cut" / "hf")
    _save_tokenizer(root / "qwen2-cut" / "hf", 200)  # the converter counts it from the directory
    cut = {k: str(root / "qwen2-cut" / k) for k in ("hf", "megatron", "back")}
    cases_file = root / "cases.json"
    roundtrip_only = {"llama-bf16": bf16, "qwen2-cut": cut, "deepseek_v3-mtp": mtp, "deepseek_v3-bf16": ds_bf16}
    everything = {
        "models": cases,
        "layouts": LAYOUTS,
        "vpp_models": ["llama"],
        "moe_models": MOE,
        "roundtrip_only": roundtrip_only,
    }
    cases_file.write_text(json.dumps(everything))
    roundtrip = run([sys.executable, str(ROOT / "tests/fixtures/convert_roundtrip.py"), str(cases_file)]).check()
    roundtrip_results = {r["model"]: r for r in roundtrip.results()}
    cases = {**cases, "deepseek_v3-mtp": mtp}
    return {"cases": cases, "file": cases_file, "roundtrip": roundtrip_results, "sample_loss": sample_loss}


def _with_mtp_layer(source: Path, target: Path) -> None:
    """DeepSeek-V3 with its MTP layer, as the published checkpoints hold it (transformers saves none):
    model.layers.{L} with a decoder layer's tensors (re-randomised), enorm, hnorm, eh_proj,
    shared_head.norm and copies of the embedding and lm_head."""
    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    tensors = load_file(source / "model.safetensors")
    last, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    for name, value in list(tensors.items()):
        if name.startswith(last):
            tensors[mtp + name[len(last) :]] = value + 0.05 * torch.randn_like(value)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{mtp}{norm}.weight"] = 1 + 0.1 * torch.randn(hidden)
    tensors[mtp + "eh_proj.weight"] = 0.08 * torch.randn(hidden, 2 * hidden)  # [embedding; hidden] in
    tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    target.mkdir(parents=True)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))


def _save_tokenizer(model_dir: Path, tokens: int) -> None:
    from tokenizers import Tokenizer, models

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(tokens)}, unk_token="t0"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(model_dir)


@pytest.mark.launch
def test_round_trip_gives_the_same_bits(models: dict) -> None:
    for family in [*CONFIGS, "llama-bf16", "qwen2-cut", "deepseek_v3-mtp", "deepseek_v3-bf16"]:
        result = models["roundtrip"][family]
        assert result["tensors"] > 4 * 6, family
        assert result["differ"] == [] and result["extra"] == [], (family, result)
    # the import did cut rows: the bits above came back from beside the checkpoint
    assert "vocabulary: 300 HF rows -> 256" in models["roundtrip"]["qwen2-cut"]["printed"]


def _hf_logits(model_dir: str | Path, tokens: torch.Tensor, work: Path) -> torch.Tensor:
    """transformers' from_pretrained + forward, in a process without the patch layer; it loads
    with no missing, unexpected or mismatched keys."""
    torch.save({"tokens": tokens}, work / "tokens.pt")
    run(
        [
            sys.executable,
            str(ROOT / "tests/fixtures/hf_logits.py"),
            str(model_dir),
            str(work / "tokens.pt"),
            str(work / "logits.pt"),
        ]
    ).check()
    out = torch.load(work / "logits.pt")
    assert out["loading"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}, out["loading"]
    return out["logits"]


@pytest.mark.launch
def test_exported_directory_loads_in_transformers(models: dict, tmp_path: Path) -> None:
    case = models["cases"]["qwen2"]
    expected = torch.load(case["expected"])
    assert torch.equal(_hf_logits(case["back"], expected["tokens"], tmp_path), expected["logits"])


@pytest.mark.launch
def test_logits_equal_transformers_under_every_layout(models: dict) -> None:
    job = torchrun(ROOT / "tests/fixtures/convert_logits.py", str(models["file"]), nproc=4).check()
    results = job.results()
    seen = {(r["model"], tuple(r["layout"].values())) for r in results}
    wanted = {
        (f, tuple(layout))
        for f in CONFIGS
        for layout in LAYOUTS
        if (layout[2] is None or f == "llama") and (layout[3] == 1 or f in MOE)
    }
    assert seen == wanted
    worst = max(results, key=lambda r: r["rel"])
    assert worst["rel"] < 1e-5, worst
    # one checkpoint, both expert modules: megatron-core's SequentialMLP at TP1, --moe-grouped-gemm's elsewhere
    experts = [(r["model"], r["layout"]["tp"], r["experts"]) for r in results if r["model"] in MOE]
    assert experts and all(e == (["SequentialMLP"] if tp == 1 else ["GroupedSequentialMLP"]) for _, tp, e in experts), (
        experts
    )


def printed_command(output: str) -> list[str]:
    """The flags `convert to-megatron` printed: the indented lines continued with a backslash."""
    lines = output.split(":\n\n", 1)[1].splitlines()
    command = []
    for line in lines:
        command.append(line.rstrip("\\"))
        if not line.endswith("\\"):
            break
    return shlex.split(" ".join(command))


def _identical_documents(prefix: Path, document: np.ndarray, count: int) -> None:
    """Documents of exactly --seq-length tokens, all the same: every training and validation
    sample is then the document plus its own first token, whatever the dataset's shuffle."""
    writer = IndexedDatasetWriter(f"{prefix}.bin", np.uint16)
    for _ in range(count):
        writer.add_document(document, [len(document)])
    writer.finalize(f"{prefix}.idx")


def _loss(logits: torch.Tensor) -> float:
    """Mean cross entropy of SAMPLE's next tokens, as pretrain_gpt.py's lm loss (no masked token)."""
    return torch.nn.functional.cross_entropy(logits, SAMPLE[1:]).item()


@pytest.mark.launch
def test_pretrain_continues_from_a_converted_llama_and_exports_back(models: dict, tmp_path: Path) -> None:
    case = models["cases"]["llama"]
    _identical_documents(tmp_path / "docs", DOCUMENT, 64)
    flags = [
        *printed_command(models["roundtrip"]["llama"]["printed"]),  # what `convert to-megatron --tp 2 --pp 2` printed
        *["--data-path", str(tmp_path / "docs"), "--split", "90,10,0"],
        *["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1)],  # NullTokenizer adds its EOD
        *["--attention-dropout", "0", "--hidden-dropout", "0", "--seq-length", str(SEQ)],
        *[
            "--train-iters",
            "3",
            "--eval-interval",
            "3",
            "--eval-iters",
            "1",
            "--save",
            str(tmp_path / "trained"),
            "--save-interval",
            "3",
        ],
    ]
    pretrain(tmp_path, *flags, nproc=4, mock_data=False).check()
    first = train_losses(tmp_path)[1]
    assert first == pytest.approx(models["sample_loss"]["llama"], rel=1e-4)

    # The TP2 x PP2 checkpoint after 3 steps (with its optimizer) back to HF: transformers'
    # loss on the same sample is the trainer's validation loss at iteration 3.
    exported = tmp_path / "exported"
    cli = [sys.executable, "-m", "megatron_npu.cli", "convert", "to-hf", str(tmp_path / "trained"), str(exported)]
    run([*cli, "--hf-config", case["hf"]]).check()
    (iteration, validation), *_ = validation_losses(tmp_path)
    assert iteration == 3
    trained = _loss(_hf_logits(exported, SAMPLE[None, :-1], tmp_path)[0])
    assert trained == pytest.approx(validation, rel=1e-4)
    assert trained != pytest.approx(first, rel=1e-3)  # it did train


def _same_bits(before: Path, after: Path) -> tuple[int, list[str]]:
    """(tensors of ``before``, names whose key, dtype, shape or bits ``after`` does not give back)."""
    from safetensors.torch import load_file

    a, b = load_file(before / "model.safetensors"), load_file(after / "model.safetensors")
    differ = [
        k
        for k in a
        if k not in b or a[k].dtype != b[k].dtype or not a[k].view(torch.uint8).equal(b[k].view(torch.uint8))
    ]
    return len(a), sorted(differ + [k for k in b if k not in a])


TP1 = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
# each new family on its hardest layout, with the flags `convert to-megatron` printed for it
PRETRAIN_LAYOUTS = {
    "qwen3": [],
    "qwen3_moe": [],
    "mixtral": ["--moe-token-dispatcher-type", "alltoall"],
    # with its MTP layer (trained beside, its loss apart from the lm loss); aux-loss-free balancing moves
    # the expert bias every step whatever the lr: held, so the save is the import
    "deepseek_v3-mtp": ["--moe-router-bias-update-rate", "0"],
    "gpt_oss": [],  # TP2 x PP2 x EP2 with SP at expert TP 1 (its expert biases), as converted
    # the dense families at TP1 on one process (converted for TP2 x PP2: the same vocabulary padding)
    **{family: [*TP1, "--global-batch-size", "2"] for family in ("llama", "qwen2", "mistral", "gpt2")},
    # the new families' conversions at TP1 x EP1 on one process as well (family@tp1)
    **{
        f"{family}@tp1": [*TP1, "--expert-model-parallel-size", "1", "--global-batch-size", "2", *flags]
        for family, flags in (
            ("qwen3", []),
            ("qwen3_moe", []),
            ("mixtral", ["--moe-token-dispatcher-type", "alltoall"]),
            ("deepseek_v3-mtp", ["--moe-router-bias-update-rate", "0"]),
            ("gpt_oss", []),
        )
    },
}


@pytest.mark.launch
@pytest.mark.parametrize("case_name", list(PRETRAIN_LAYOUTS))
def test_pretrain_first_loss_equals_transformers_and_a_save_exports_the_same_bits(
    models: dict, case_name: str, tmp_path: Path
) -> None:
    """One pretrain_gpt.py job per family (Qwen3 TP2 x PP2; the MoE families TP2 x EP2 with SP, their
    experts as --moe-grouped-gemm, Mixtral's over the alltoall dispatcher; DeepSeek-V3 likewise; gpt-oss
    TP2 x PP2 x EP2 with SP, its biased experts at expert TP 1, and its published YaRN; every family also at
    TP1 x EP1 on one rank): its first loss is transformers' on the same tokens; 2 steps at lr 0, saved,
    exported: every HF tensor, bit for bit."""
    family, layout = case_name.split("@")[0], PRETRAIN_LAYOUTS[case_name]
    case = models["cases"][family]
    _identical_documents(tmp_path / "docs", DOCUMENT, 64)
    flags = [
        *printed_command(models["roundtrip"][family]["printed"]),
        *layout,
        *["--data-path", str(tmp_path / "docs"), "--split", "100,0,0", "--eval-iters", "0"],
        *["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1)],
        *["--attention-dropout", "0", "--hidden-dropout", "0", "--seq-length", str(SEQ)],
        *["--lr", "0", "--min-lr", "0", "--lr-warmup-iters", "0", "--train-iters", "2"],
        *["--save", str(tmp_path / "saved"), "--save-interval", "2"],
    ]
    pretrain(tmp_path, *flags, nproc=1 if layout[:2] == TP1[:2] else 4, mock_data=False).check()
    losses = train_losses(tmp_path)
    assert losses[1] == pytest.approx(models["sample_loss"][family], rel=1e-5)
    assert losses[2] == pytest.approx(losses[1], rel=1e-6)  # lr 0: the weights did not move
    exported = tmp_path / "exported"
    cli = [sys.executable, "-m", "megatron_npu.cli", "convert", "to-hf", str(tmp_path / "saved"), str(exported)]
    run([*cli, "--hf-config", case["hf"]]).check()
    tensors, differ = _same_bits(Path(case["hf"]), exported)
    assert tensors > 4 * 6 and differ == [], differ


@pytest.mark.launch
def test_refusals_name_the_fix(models: dict, tmp_path: Path) -> None:
    llama = read_config(models["cases"]["llama"]["hf"])
    with pytest.raises(ConvertError, match="^num_attention_heads 4 is not divisible by --tp 8$"):
        model_spec(llama, tp=8)
    with pytest.raises(ConvertError, match="^num_key_value_heads 2 is not divisible by --tp 4; use a TP size"):
        model_spec(llama, tp=4)
    with pytest.raises(ConvertError, match="^intermediate_size 96 is not divisible by --tp 64$"):
        model_spec({**llama, "num_attention_heads": 64, "num_key_value_heads": 64}, tp=64)
    with pytest.raises(ConvertError, match="unsupported architecture BertModel"):
        model_spec({"architectures": ["BertModel"], "model_type": "bert"})
    with pytest.raises(ConvertError, match="tokenizer has 200 tokens but the model's embedding has 128 rows"):
        model_spec(llama, tokenizer_vocab=200)
    # A missing shard: refused by the command, in one line, before megatron-core is imported.
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps(llama))
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (sharded / "model-00002-of-00002.safetensors").write_bytes(b"")
    job = subprocess.run(
        [sys.executable, "-m", "megatron_npu.cli", "convert", "to-megatron", str(sharded), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=base_env(),
        timeout=600,
    )
    assert job.returncode == 2
    assert job.stderr.strip().splitlines() == [
        f"megatron-npu convert: error: {sharded}: shard model-00001-of-00002.safetensors named by "
        "model.safetensors.index.json is missing: download it again"
    ]


@pytest.mark.launch
def test_refusals_of_the_command(models: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Refused by `convert to-megatron` in one line, before megatron-core starts (so in this process)."""
    from megatron_npu.convert.cli import main as convert

    def refusal(hf_dir: Path, *flags: str) -> str:
        assert convert(["to-megatron", str(hf_dir), str(tmp_path / "out"), *flags]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        return line.removeprefix("megatron-npu convert: error: ")

    # The tokenizer is counted from the model directory: one larger than the embedding is refused.
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(Path(models["cases"]["llama"]["hf"], "config.json").read_text())
    _save_tokenizer(llama, VOCAB + 1)
    assert refusal(llama) == (
        f"the tokenizer has {VOCAB + 1} tokens but the model's embedding has {VOCAB} rows: "
        "use the model's own tokenizer (or pass its size with --tokenizer-vocab-size)"
    )
    # Mistral's sliding window: full attention is the same only up to the window.
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    config = read_config(models["cases"]["mistral"]["hf"])
    (mistral / "config.json").write_text(json.dumps({**config, "sliding_window": 16}))
    assert refusal(mistral, "--seq-length", "32") == (
        "sliding-window attention (16 tokens) at --seq-length 32: pretrain_gpt.py's attention has no window, "
        "so it would differ; convert and train with --seq-length 16 or less"
    )
    assert refusal(mistral) == refusal(mistral, "--seq-length", "64")  # the default: max_position_embeddings
    check_attention_window({**config, "sliding_window": 16}, 16)  # up to the window: accepted
    check_attention_window({**config, "sliding_window": 16, "use_sliding_window": False}, 64)  # Qwen2's switch
    # Linear RoPE scaling: the trainer's --rotary-seq-len-interpolation-factor is an integer.
    linear = {**read_config(models["cases"]["llama"]["hf"]), "rope_scaling": {"rope_type": "linear", "factor": 2.5}}
    with pytest.raises(ConvertError, match="linear RoPE scaling by 2.5: .* takes an integer"):
        model_spec(linear)


def test_linear_rope_scaling_gives_transformers_angles() -> None:
    """HF's linear scaling divides the frequencies, megatron-core's interpolation factor the
    positions: pretrain_gpt.py, given the printed flag, rotates by the same angles; dynamic NTK
    scaling, up to the original length, by plain RoPE's."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_npu.convert.megatron_io import args_record

    config = transformers.LlamaConfig(
        **COMMON, num_attention_heads=4, rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}
    )
    spec = model_spec(config.to_dict())
    assert "--rotary-seq-len-interpolation-factor 4" in " ".join(spec.flags())
    args = args_record(spec)  # the flags as pretrain_gpt.py's parser reads them
    megatron = RotaryEmbedding(
        kv_channels=spec.kv_channels,
        rotary_percent=1.0,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        rotary_base=args.rotary_base,
        use_cpu_initialization=True,
    )(SEQ)[:, 0, 0]
    positions = torch.arange(SEQ)[None]
    cos, sin = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)(megatron[None], positions)
    torch.testing.assert_close(megatron.cos(), cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(megatron.sin(), sin[0], rtol=1e-6, atol=1e-6)
    # dynamic NTK up to the original length (max_position_embeddings 64 here): the printed flags' plain RoPE
    dynamic = transformers.LlamaConfig(
        **COMMON, num_attention_heads=4, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}
    )
    args = args_record(model_spec(dynamic.to_dict()))
    assert args.rotary_seq_len_interpolation_factor is None and not args.use_rope_scaling
    plain = RotaryEmbedding(
        kv_channels=spec.kv_channels, rotary_percent=1.0, rotary_base=args.rotary_base, use_cpu_initialization=True
    )(64)[:, 0, 0]
    cos, _ = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(dynamic)(plain[None], torch.arange(64)[None])
    torch.testing.assert_close(plain.cos(), cos[0], rtol=1e-6, atol=1e-6)


@pytest.mark.launch
def test_printed_flags_describe_the_model(models: dict) -> None:
    llama = model_spec(read_config(models["cases"]["llama"]["hf"]), tp=2).flags()
    text = " ".join(llama)
    for expected in (
        "--num-layers 4",
        "--hidden-size 64",
        "--group-query-attention --num-query-groups 2",
        "--ffn-hidden-size 96",
        "--normalization RMSNorm --swiglu --disable-bias-linear",
        "--rotary-base 500000",
        "--use-rope-scaling --rope-scaling-factor 8.0",
        "--untie-embeddings-and-output-weights",
        "--norm-epsilon 1e-05",
        "--make-vocab-size-divisible-by 64",
    ):
        assert expected in text
    qwen2 = " ".join(model_spec(read_config(models["cases"]["qwen2"]["hf"])).flags())
    assert "--add-qkv-bias" in qwen2 and "--untie" not in qwen2 and "--rotary-base 1000000" in qwen2
    gpt2 = " ".join(model_spec(read_config(models["cases"]["gpt2"]["hf"])).flags())
    assert "--position-embedding-type learned_absolute --openai-gelu" in gpt2 and "--swiglu" not in gpt2
    mistral = " ".join(model_spec(read_config(models["cases"]["mistral"]["hf"])).flags())
    assert "--kv-channels 32" in mistral


@pytest.mark.launch
def test_vocabulary_padding_follows_the_tokenizer(models: dict) -> None:
    qwen2 = read_config(models["cases"]["qwen2"]["hf"])
    # The tokenizer's count pads to the model's rows: every row kept.
    spec = model_spec(qwen2, tp=2, tokenizer_vocab=100)
    assert (spec.padded_vocab_size, spec.make_vocab_size_divisible_by) == (128, 64)
    # Qwen2.5's: 151,665 tokens, 151,936 rows. No power of two pads one to the other: Megatron-LM's
    # 128 x TP, and the unused rows past 151,808 are cut.
    spec = model_spec({**qwen2, "vocab_size": 151936}, tp=2, tokenizer_vocab=151665)
    assert (spec.padded_vocab_size, spec.make_vocab_size_divisible_by) == (151808, 128)


def _config(family: str, **changes: object) -> dict:
    """A CONFIGS entry as config.json holds it, with ``changes``."""
    return {**CONFIGS[family]().to_dict(), **changes}


def test_the_model_convert_builds_is_the_one_pretrain_gpt_builds_from_the_printed_flags() -> None:
    """convert builds its model from the model's sections (its printed flags, no trainer start-up) and a TP1
    layout: every family's TransformerConfig equals the one pretrain_gpt.py's parser and validation give."""
    import dataclasses
    import functools

    from megatron_npu.convert.megatron_io import args_record, model_sections
    from megatron_npu.training.config import transformer_config

    def fields(config: object) -> dict:
        out = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        return {k: (v.func, v.args, v.keywords) if isinstance(v, functools.partial) else v for k, v in out.items()}

    for family in CONFIGS:
        spec = model_spec(_config(family), with_mtp=family.startswith("deepseek"))
        built, parsed = transformer_config(model_sections(spec)), transformer_config(args_record(spec))
        assert type(built) is type(parsed) and fields(built) == fields(parsed), family
        assert {k: v for k, v in vars(built).items() if k.startswith("yarn_")} == {
            k: v for k, v in vars(parsed).items() if k.startswith("yarn_")
        }, family


def test_printed_flags_of_the_new_families() -> None:
    qwen3 = " ".join(model_spec(_config("qwen3")).flags())
    assert "--qk-layernorm" in qwen3 and "--kv-channels 32" in qwen3 and "--num-experts" not in qwen3
    qwen3_moe = " ".join(model_spec(_config("qwen3_moe"), tp=2, ep=2).flags())
    for expected in (
        "--qk-layernorm",
        "--num-experts 4 --moe-ffn-hidden-size 32 --moe-router-topk 2 --moe-grouped-gemm",
        "--moe-router-pre-softmax",  # norm_topk_prob false: top-k of a softmax over all experts
        "--moe-layer-freq [1,0,1,1]",  # mlp_only_layers [1]
    ):
        assert expected in qwen3_moe
    mixtral = " ".join(model_spec(_config("mixtral")).flags())
    assert "--num-experts 4 --moe-ffn-hidden-size 96" in mixtral
    assert "--moe-router-pre-softmax" not in mixtral and "--moe-layer-freq" not in mixtral
    deepseek = " ".join(model_spec(_config("deepseek_v3"), tp=2, ep=2).flags())
    for expected in (
        "--multi-latent-attention --qk-layernorm --kv-lora-rank 16 --q-lora-rank 32 --qk-head-dim 16 "
        "--qk-pos-emb-head-dim 8 --v-head-dim 16",
        "--rope-type yarn --rotary-scaling-factor 4.0 --mscale 1.0 --mscale-all-dim 1.0",
        "--moe-layer-freq [0,1,1,1]",  # first_k_dense_replace 1
        "--moe-shared-expert-intermediate-size 32",
        "--moe-router-score-function sigmoid --moe-router-dtype fp32 --moe-router-enable-expert-bias",
        "--moe-router-num-groups 2 --moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5",
    ):
        assert expected in deepseek
    no_q = " ".join(model_spec(_config("deepseek_v3-noq")).flags())
    assert "--q-lora-rank" not in no_q and "--rope-type rope" in no_q and "--moe-router-num-groups" not in no_q
    assert "--moe-shared-expert-intermediate-size 64" in no_q  # two shared experts of 32
    gpt_oss = " ".join(model_spec(_config("gpt_oss"), ep=2).flags())
    for expected in (
        "--softmax-type learnable --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0",
        "--window-size 7,0 --window-attn-skip-freq 2",  # HF's 8-token window; layers 1, 3 (1-based) windowed
        "--num-experts 4 --moe-ffn-hidden-size 32 --moe-router-topk 2",
    ):
        assert expected in gpt_oss
    assert "--disable-bias-linear" not in gpt_oss and "--swiglu" not in gpt_oss  # biases: Megatron-LM's default
    # under TP: sequence parallelism (MoE) and expert TP 1 (megatron-core splits no expert bias)
    assert layout_flags(model_spec(_config("gpt_oss"), tp=2, ep=2), tp=2, pp=1, vpp=None, ep=2)[-3:] == [
        "--sequence-parallel",
        "--expert-tensor-parallel-size",
        "1",
    ]
    assert "--expert-tensor-parallel-size" not in layout_flags(
        model_spec(_config("mixtral"), tp=2), tp=2, pp=1, vpp=None, ep=1
    )
    # the published YaRN: Megatron-LM core_v0.16.1's --rotary-scaling-factor and core_v0.19.0's --yarn-* flags
    assert (
        "--position-embedding-type yarn --rotary-base 150000" in gpt_oss
        and "--rotary-scaling-factor 32.0 --yarn-original-max-position-embeddings 4096 --yarn-beta-fast 32.0 "
        "--yarn-beta-slow 1.0 --no-yarn-correction-range-round-to-int --untie"
        in gpt_oss
    )
    # other families' YaRN (LLaMA, Qwen): transformers' defaults (beta 32 / 1, truncate), mscale / mscale_all_dim
    # only when both are given (else transformers' attention factor is yarn_get_mscale(factor): 1 / 0 here)
    for extra, printed in (
        ({}, "--yarn-beta-slow 1.0 --untie"),
        ({"mscale": 0.707, "mscale_all_dim": 0.0}, "--yarn-beta-slow 1.0 --untie"),
        ({"mscale": 1.0, "mscale_all_dim": 0.5}, "--yarn-beta-slow 1.0 --mscale 1.0 --mscale-all-dim 0.5 --untie"),
    ):
        yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32, **extra}
        llama = " ".join(model_spec(_config("llama", rope_parameters=yarn)).flags())
        assert "--rotary-scaling-factor 4.0 --yarn-original-max-position-embeddings 32 --yarn-beta-fast 32.0" in llama
        assert printed in llama and "--use-rope-scaling" not in llama
    full_first = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert "--window-attn-skip-freq [0,1,1,0]" in " ".join(
        model_spec(_config("gpt_oss", layer_types=full_first)).flags()
    )


def test_refusals_of_the_new_families(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Layouts that cannot split the model and options megatron-core cannot express: one line each,
    from the config alone (hf_config imports no torch)."""

    def refused(cfg: dict, **layout: int) -> str:
        with pytest.raises(ConvertError) as error:
            model_spec(cfg, **layout)
        return str(error.value)

    assert refused(_config("mixtral"), ep=8) == (
        "num_local_experts 4 is not divisible by --ep 8: choose an EP size that divides the experts"
    )
    assert refused(_config("qwen3_moe", moe_intermediate_size=30, num_key_value_heads=4), tp=4) == (
        "moe_intermediate_size 30 is not divisible by --tp 4"
    )
    assert refused(_config("qwen3"), ep=2) == "--ep 2 for a dense model (qwen3 has no experts): use --ep 1"
    assert refused(_config("deepseek_v3", q_lora_rank=30), tp=4) == "q_lora_rank 30 is not divisible by --tp 4"
    assert refused(_config("deepseek_v3", kv_lora_rank=15), tp=2) == (
        "kv_lora_rank + qk_rope_head_dim (23) is not divisible by --tp 2"
    )
    assert "n_routed_experts 8 is not divisible by --ep 3" in refused(_config("deepseek_v3"), ep=3)
    assert "norm_topk_prob false" in refused(_config("deepseek_v3", norm_topk_prob=False))
    assert "scores a group by its best 1 experts, transformers by its best 2" in refused(
        _config("deepseek_v3", topk_group=2, num_experts_per_tok=2)
    )
    yarn = {**_config("deepseek_v3")["rope_parameters"], "beta_fast": 16.0}
    assert "YaRN with {'beta_fast': 16.0}" in refused(_config("deepseek_v3", rope_parameters=yarn))
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}  # DeepSeek-V3 as published
    assert "quantized weights (fp8): dequantize them to bf16 first" in refused(
        _config("deepseek_v3", quantization_config=fp8)
    )
    assert "swiglu_alpha 1.5" in refused(_config("gpt_oss", swiglu_alpha=1.5))
    llama = _config("llama")
    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}
    assert "RoPE scaling type 'longrope' is not supported" in refused({**llama, "rope_parameters": longrope})
    # YaRN on standard attention: an attention factor or a partial rotation megatron-core's YaRN cannot take
    for changed, said in (({"attention_factor": 1.0}, "attention_factor 1.0"), ({"partial_rotary_factor": 0.5}, "")):
        assert "YaRN with " + (said or "partial_rotary_factor") in refused(
            _config("gpt_oss", rope_parameters={**GPT_OSS_YARN, **changed})
        )
    # dynamic NTK: plain RoPE up to the original length, refused past it (by the command, before megatron-core)
    dynamic = {**llama, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}
    assert "--use-rope-scaling" not in model_spec(dynamic).flags()
    check_attention_window(dynamic, 64)
    (tmp_path / "dynamic").mkdir()
    (tmp_path / "dynamic" / "config.json").write_text(json.dumps(dynamic))
    from megatron_npu.convert.cli import main as convert

    assert convert(["to-megatron", str(tmp_path / "dynamic"), str(tmp_path / "out"), "--seq-length", "128"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "megatron-npu convert: error: dynamic NTK RoPE scaling at --seq-length 128: it rescales past 64 tokens, "
        "which megatron-core's RotaryEmbedding cannot; convert and train with --seq-length 64 or less"
    ]


def test_mtp_copies_of_the_embedding_and_output_layer_must_equal_the_main_models(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """DeepSeek-V3's MTP layer holds its own embed_tokens and shared_head.head, which megatron-core's MTP layer
    takes from the main model: equal copies convert (the fixture's MTP model), a differing one is refused by the
    command in one line, before megatron-core is imported (only the tensors the check reads are in the directory)."""
    from safetensors.torch import save_file

    from megatron_npu.convert.cli import main as convert

    config = _config("deepseek_v3", num_nextn_predict_layers=1)
    mtp = f"model.layers.{config['num_hidden_layers']}."
    embedding, output = torch.randn(VOCAB, config["hidden_size"]), torch.randn(VOCAB, config["hidden_size"])
    tensors = {
        "model.embed_tokens.weight": embedding,
        "lm_head.weight": output,
        mtp + "eh_proj.weight": torch.randn(config["hidden_size"], 2 * config["hidden_size"]),
        mtp + "embed_tokens.weight": embedding.clone(),
        mtp + "shared_head.head.weight": output.clone(),
    }
    for name, copy in (("embed_tokens", "model.embed_tokens"), ("shared_head.head", "lm_head")):
        changed = tmp_path / name
        changed.mkdir()
        (changed / "config.json").write_text(json.dumps(config))
        one_bit = tensors[f"{mtp}{name}.weight"].clone()
        one_bit.view(torch.int32)[3, 5] ^= 1  # the last bit of one element
        save_file({**tensors, f"{mtp}{name}.weight": one_bit}, changed / "model.safetensors")
        assert convert(["to-megatron", str(changed), str(tmp_path / "out"), "--tp", "2", "--ep", "2"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"megatron-npu convert: error: {changed}: {mtp}{name}.weight differs from {copy}.weight: megatron-core's "
            "MTP layer shares the main model's embedding and output layer, so this checkpoint cannot be trained as it "
            "is (give its MTP layer the main model's tensors, as DeepSeek-V3's own checkpoints hold them)"
        ]
    assert not (tmp_path / "out").exists()
