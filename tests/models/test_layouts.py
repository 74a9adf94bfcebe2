"""Layouts the model families are trained at besides test_families.py's, exact against one rank in pretrain_gpt.py.

* ``--pipeline-model-parallel-layout``: the DeepSeek-V3-style model (MLA, MoE, MTP; test_families.py's flags) on
  the scaled-down form of DeepSeek-V3's layout ``Et|(tt|)*30mL``, ``Et|(t|)*2mL``: PP2 with two virtual stages
  per rank, the embedding and a decoder layer first, the MTP layer and the loss alone on the last virtual stage.
  It trains 3 iterations and saves at 1; one rank resumes that save and trains 2 and 3 with the same lm, MTP and
  aux losses (rel 1e-5): a layout-string save resumes exactly at another layout.
* ``--context-parallel-size 2`` for the families (LLaMA-3.x, Qwen3 with QK norm, the DeepSeek-V3-style model's
  multi-latent attention with its separate q/k and v head sizes, YaRN, MoE and MTP; gpt-oss's sliding-window
  layers, full layers and learnable sinks, with its experts over EP2; the ring's p2p or the all-to-all): from a
  common one-rank checkpoint, CP2's lm, MTP and aux losses equal the one-rank run's (rel 1e-5; the MTP loss through
  megatron_npu/patches/mtp_context_parallel.py, rel 3.5e-5 without it).
* A layout megatron-core would assert on building the model (after the process groups exist) is refused at start-up
  in one line: the trainer's verdict is megatron-core's PipelineParallelLayerLayout's on each layout here.
"""

from __future__ import annotations

import json

import pytest
from pretrain_runs import MOCK_DATA, MODEL, checkpoint_at, metrics, pretrain
from test_families import COMMON, FAMILIES, LOSS_NAMES

from megatron_npu.policy import ConfigError
from megatron_npu.training.arguments import parse_args

DEEPSEEK = FAMILIES["deepseek_v3"][0]
# DeepSeek-V3's Et|(tt|)*30mL scaled to its 3 layers: stages Et | t | t | mL over PP2 = two virtual stages a rank
LAYOUT = ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|(t|)*2mL"]
# each family's CP2 run: the ring (p2p) and the all-to-all over the heads (a2a)
CONTEXT_PARALLEL = {
    "llama3": ["--context-parallel-size", "2", "--cp-comm-type", "p2p"],
    "qwen3": ["--context-parallel-size", "2", "--cp-comm-type", "a2a"],
    # MLA's keys (qk_head_dim + qk_pos_emb_head_dim) and values (v_head_dim) of different sizes on the ring
    "deepseek_v3": ["--context-parallel-size", "2", "--cp-comm-type", "p2p"],
    # --window-size 8,0 at seq 32: the ring's blocks fully visible, cut by the window and skipped; the sinks' term in
    # its last merge; the experts over EP2 (the CP pair)
    "gpt_oss": ["--context-parallel-size", "2", "--cp-comm-type", "p2p", "--expert-model-parallel-size", "2"],
}


def _losses(run, after: int = 0) -> dict[int, dict[str, float]]:
    """Each iteration's losses (metrics.jsonl names) after iteration ``after``."""
    return {
        m["iteration"]: {k: m[k] for k in LOSS_NAMES if k in m}
        for m in metrics(run)
        if "lm_loss" in m and m["iteration"] > after
    }


def _assert_equal(got: dict, expected: dict) -> None:
    """Iterations 2 and 3 with the same losses (rel 1e-5)."""
    assert sorted(got) == [2, 3] and all(set(got[i]) == set(expected[i]) for i in got), (got, expected)
    for i in got:
        for name, value in got[i].items():
            assert value == pytest.approx(expected[i][name], rel=1e-5), (i, name, got[i], expected[i])


@pytest.mark.launch
def test_deepseek_v3_layout_string_save_resumes_exactly_on_one_rank(tmp_path):
    layout = tmp_path / "layout"
    job = pretrain(layout, *COMMON, *DEEPSEEK, *LAYOUT, "--save", str(layout / "ckpt"), "--save-interval", "1", nproc=2)
    job.check()
    assert "mtp_1 loss:" in job.stdout  # the MTP layer on the last virtual stage reports, as Megatron-LM prints it
    assert json.loads((layout / "logs" / "args.json").read_text())["virtual_pipeline_model_parallel_size"] == 2
    one = tmp_path / "one"
    pretrain(one, *COMMON, *DEEPSEEK, "--load", str(checkpoint_at(layout / "ckpt", 1, one / "load"))).check()
    expected = _losses(layout, after=1)
    assert all("mtp_1 loss" in v and "seq_load_balancing_loss" in v for v in expected.values()), expected
    _assert_equal(_losses(one), expected)


@pytest.mark.launch
@pytest.mark.parametrize("family", list(CONTEXT_PARALLEL))
def test_family_trains_exactly_under_context_parallelism(family, tmp_path):
    flags = FAMILIES[family][0]
    one = tmp_path / "one"
    pretrain(one, *COMMON, *flags, "--save", str(one / "ckpt"), "--save-interval", "1").check()
    cp = tmp_path / "cp"
    load = checkpoint_at(one / "ckpt", 1, cp / "load")
    pretrain(cp, *COMMON, *flags, *CONTEXT_PARALLEL[family], "--load", str(load), nproc=2).check()
    _assert_equal(_losses(cp), _losses(one, after=1))


# layouts of the 3-layer, 1-MTP-layer model at PP2: megatron-core's parser and validate_layer_layout decide
LAYOUTS = [
    "Et|(t|)*2mL",  # the one trained above
    "Ett|tmL",
    "Et|t|tm|L",  # MTP alone on the first rank's last virtual stage (megatron-core's mtp_standalone)
    "Et|t|tt|mL",  # four decoder layers
    "Et|t|t|L",  # no MTP layer
    "Et|mt|t|L",  # a decoder layer after MTP
    "Etm|t|t|L",  # MTP on a rank's first virtual stage
    "t|Et|t|mL",
    "Et|t|t|mLL",
    "Et|x|t|mL",
]


def _trainer_verdict(*flags: str) -> str | None:
    """None where pretrain_gpt.py's parser and validation accept the flags at PP2, else the one-line refusal."""
    argv = [*MODEL, *MOCK_DATA, *COMMON, *DEEPSEEK, "--pipeline-model-parallel-size", "2", *flags]
    try:
        parse_args(argv, world_size=2, check_paths=False)
    except ConfigError as error:
        return str(error)
    return None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_strings_megatron_core_asserts_on_are_refused_at_start_up(layout):
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    try:
        PipelineParallelLayerLayout(layout, 2).validate_layer_layout(num_layers=3, mtp_num_layers=1)
        runs = True
    except AssertionError:
        runs = False
    said = _trainer_verdict("--pipeline-model-parallel-layout", layout)
    assert (said is None) == runs, (layout, runs, said)
    assert said is None or ("\n" not in said and f"--pipeline-model-parallel-layout {layout!r}" in said), said


@pytest.mark.parametrize(
    "other", [["--decoder-first-pipeline-num-layers", "1"], ["--account-for-embedding-in-pipeline-split"]]
)
def test_a_layout_string_with_other_stage_flags_is_refused_naming_them(other):
    said = _trainer_verdict("--pipeline-model-parallel-layout", "Et|(t|)*2mL", *other)
    assert said and "\n" not in said and f"drop {other[0]}" in said, said
