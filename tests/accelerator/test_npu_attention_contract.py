"""The fused attention's masks and windows against the torch_npu wheel (read, never imported): the op's
arguments and defaults in its meta registration, and the semantics its own docstrings
(``torch_npu/_op_plugin_docs.py``, CANN's operator documentation) give for what we pass.

tests/ops/test_fused_attention_masks.py runs the npu target's call over an emulation written from the
same semantics; this file pins those semantics to the wheel.
"""

from __future__ import annotations

import ast
import zipfile

import pytest
from accelerator.test_npu_contract import registered_ops

from megatron_npu.accelerator import npu

OP = "npu_fusion_attention"


@pytest.fixture(scope="module")
def op_doc(torch_npu_wheel: zipfile.ZipFile) -> str:
    """npu_fusion_attention's docstring in the wheel, whitespace folded."""
    source = torch_npu_wheel.read("torch_npu/_op_plugin_docs.py").decode()
    start = source.index(f'"{OP}"')
    return " ".join(source[start : source.index("_add_torch_npu_docstr", start)].split())


def _meta_defaults(wheel: zipfile.ZipFile) -> dict[str, object]:
    tree = ast.parse(wheel.read("torch_npu/op_plugin/meta/_meta_registrations.py").decode())
    function = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == f"{OP}_forward")
    names = [a.arg for a in function.args.args]
    defaults = function.args.defaults
    return {name: ast.literal_eval(d) for name, d in zip(names[len(names) - len(defaults) :], defaults, strict=True)}


def test_the_op_takes_the_mask_arguments_we_pass_with_the_defaults_we_assume(torch_npu_wheel):
    assert registered_ops(torch_npu_wheel)[OP][:5] == ["query", "key", "value", "head_num", "input_layout"]
    defaults = _meta_defaults(torch_npu_wheel)
    # the causal call keeps every key before the diagonal: pre_tockens' default is "all"
    assert defaults["pre_tockens"] == defaults["next_tockens"] == npu._ALL_TOKENS
    assert defaults["sparse_mode"] == 0 and defaults["atten_mask"] is None


def test_atten_mask_true_is_masked_and_takes_megatrons_b1ss_document_masks(op_doc):
    assert "atten_mask: Tensor类型, 可选参数, 取值为1(或True)代表该位不参与计算(被遮蔽)" in op_doc
    assert "B1SS格式" in op_doc  # megatron's reset-attention-mask is [b, 1, sq, sk]
    assert "0: defaultMask模式" in op_doc


def test_sparse_mode_4_is_the_band_of_pre_and_next_tokens_over_the_compressed_mask(op_doc):
    band = op_doc[op_doc.index("sparse_mode为4时") :][:200]
    assert "代表band场景, 即计算pre_tockens和next_tockens之间的部分" in band
    assert "atten_mask为优化后的压缩下三角矩阵(2048*2048)" in band
    assert npu._COMPRESSED_MASK == 2048
    mask, mode, pre, after = npu._attention_sparsity(8, 8, "cpu", None, (3, 0))
    assert (mode, pre, after) == (4, 3, 0) and mask.shape == (2048, 2048) and bool(mask[0, 1])
    assert not bool(mask[1, 0])  # lower triangle kept


def test_a_document_mask_goes_through_default_mask_mode_with_every_key_in_the_band():
    import torch

    mask = torch.zeros(2, 1, 8, 8, dtype=torch.bool)
    passed, mode, pre, after = npu._attention_sparsity(8, 8, "cpu", mask, None)
    assert passed is not None and mode == 0 and pre == after == npu._ALL_TOKENS
