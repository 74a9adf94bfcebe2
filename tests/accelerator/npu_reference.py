"""Reference implementations of the torch_npu operators and ``torch.npu`` calls this project uses (tests only).

Written from CANN's operator documentation as the torch_npu 2.14.0 wheel ships it (``torch_npu/_op_plugin_docs.py``,
the same text as hiascend.com's "torch_npu.npu_*" API pages) argument by argument, with the wheel's meta
registrations (``torch_npu/op_plugin/meta/_meta_registrations.py``) for parameter names, defaults and output shapes
(tests/accelerator/test_npu_reference.py checks both against the wheel, and every operator against plain torch math).

Strict where the documentation states a constraint the kernel does not check for us: an argument combination CANN
says gives wrong results ("参数取值与atten_mask分布不一致会导致精度问题") raises here, so a run on these references
fails where hardware would silently compute something else. What the project never passes (pse, prefix, quantized
grouped matmul, sparse modes 5-8) raises NotImplementedError instead of guessing.

Never imported outside tests: the emulated npu target (tests/npu_emulation/) builds its ``torch_npu`` from it.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import types
from collections.abc import Sequence
from typing import Any

import torch

#: npu_fusion_attention's pre_tockens / next_tockens default: every key ("int pre_tockens=2147483647")
ALL_TOKENS = 2147483647
#: sparse_mode 2, 3, 4 (and 7, 8) read an "优化后的压缩下三角矩阵(2048*2048)": triu(ones(2048, 2048), 1), True = masked
COMPRESSED_MASK_SIZE = 2048
#: the softmax statistics' last dimension: "[B, head_num, S1, 8]" in the meta registration (each value repeated)
STATS_WIDTH = 8
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
SPARSE_MODES = {0: "defaultMask", 1: "allMask", 2: "leftUpCausal", 3: "rightDownCausal", 4: "band"}


class DocumentedMisuse(ValueError):
    """An argument combination CANN's documentation says the kernel computes wrongly or refuses."""


# ------------------------------------------------------------------------------------------------------------------
# npu_fusion_attention / npu_fusion_attention_grad
# Source: torch_npu 2.14.0 torch_npu/_op_plugin_docs.py "npu_fusion_attention" (= hiascend.com, torch_npu API list,
# "torch_npu.npu_fusion_attention"; sparse modes also in CANN ops-transformer docs/context/sparse_mode参数说明.md);
# grad: the wheel's meta registration "npu_fusion_attention_grad" (arguments, dq/dk/dv shapes).
# ------------------------------------------------------------------------------------------------------------------


def _to_bnsd(x: torch.Tensor, heads: int, layout: str) -> torch.Tensor:
    """query/key/value in ``layout`` -> [B, N, S, D] ("输入query、key、value的input_layout必须一致")."""
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.permute(0, 2, 1, 3)
    if layout == "BSH":
        b, s, h = x.shape
        return x.view(b, s, heads, h // heads).permute(0, 2, 1, 3)
    if layout == "SBH":
        s, b, h = x.shape
        return x.view(s, b, heads, h // heads).permute(1, 2, 0, 3)
    raise DocumentedMisuse(f"input_layout {layout!r}: supported {', '.join(LAYOUTS)}")


def _from_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, N, S, D] -> ``layout`` (the output keeps the input's layout, D of value)."""
    b, n, s, d = x.shape
    if layout == "BNSD":
        return x.contiguous()
    if layout == "BSND":
        return x.permute(0, 2, 1, 3).contiguous()
    if layout == "BSH":
        return x.permute(0, 2, 1, 3).reshape(b, s, n * d)
    return x.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


def _heads_of(x: torch.Tensor, layout: str, head_dim: int) -> int:
    """N of key/value: their own axis in 4-d layouts, H / D in BSH / SBH (D of query: "Dq=Dk")."""
    if layout in ("BSND", "TND"):
        return x.shape[-2]
    if layout == "BNSD":
        return x.shape[1]
    return x.shape[-1] // head_dim


def _check_compressed(atten_mask: torch.Tensor | None, sparse_mode: int) -> None:
    """sparse_mode 2 / 3 / 4: "atten_mask为优化后的压缩下三角矩阵(2048*2048)" (True above the diagonal)."""
    expected = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool).triu(diagonal=1)
    if (
        atten_mask is None
        or tuple(atten_mask.shape) != expected.shape
        or not torch.equal(atten_mask.bool().cpu(), expected)
    ):
        raise DocumentedMisuse(
            f"sparse_mode {sparse_mode} ({SPARSE_MODES[sparse_mode]}) takes the compressed 2048 x 2048 lower-triangular "
            "atten_mask (torch.triu(torch.ones(2048, 2048), 1).bool()); another mask gives wrong results"
        )


def _band(sq: int, sk: int, pre: int, nxt: int, origin: int, device: torch.device) -> torch.Tensor:
    """[Sq, Sk] True where key j is inside the band of query i: i + origin - pre <= j <= i + origin + next
    (origin 0: the top-left corner; Sk - Sq: "参数起点为右下角")."""
    rows = torch.arange(sq, device=device).view(-1, 1) + origin
    cols = torch.arange(sk, device=device).view(1, -1)
    return (cols >= rows - min(pre, ALL_TOKENS)) & (cols <= rows + min(nxt, ALL_TOKENS))


def _mask_as_b1ss(atten_mask: torch.Tensor, sq: int, sk: int) -> torch.Tensor:
    """atten_mask in one of "BNSS格式、B1SS格式、11SS格式、SS格式" -> 4-d, True = masked ("取值为1(或True)代表该位不参与计算")."""
    if atten_mask.dtype not in (torch.bool, torch.uint8):
        raise DocumentedMisuse(f"atten_mask dtype {atten_mask.dtype}: bool or uint8 only")
    mask = atten_mask.bool()
    if mask.dim() == 2:
        mask = mask.view(1, 1, *mask.shape)
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (sq, sk):
        raise DocumentedMisuse(
            f"atten_mask shape {tuple(atten_mask.shape)}: SS, 11SS, B1SS or BNSS with SS = ({sq}, {sk})"
        )
    return mask


def _kept(
    sq: int,
    sk: int,
    atten_mask: torch.Tensor | None,
    sparse_mode: int,
    pre: int,
    nxt: int,
    device: torch.device,
) -> torch.Tensor | None:
    """Which scores take part: a bool tensor broadcastable to [B, N, Sq, Sk] (True = kept), None = every one.

    "当atten_mask输入为None时, sparse_mode, pre_tockens, next_tockens参数不生效, 固定为全计算": no mask, no sparsity.
    """
    if sparse_mode not in SPARSE_MODES:
        raise NotImplementedError(f"sparse_mode {sparse_mode} (prefix / varlen split modes): the project passes 0-4")
    if atten_mask is None:
        return None
    if sparse_mode == 0:
        # defaultMask: the full mask, and the pre/next band must agree with it (top-left origin, as the doc's example
        # builds it: triu(k=next+1) + tril(k=-pre-1)); "参数取值与atten_mask分布不一致会导致精度问题"
        kept = ~_mask_as_b1ss(atten_mask, sq, sk)
        band = _band(sq, sk, pre, nxt, 0, device)
        if bool((kept & ~band).any()):
            raise DocumentedMisuse(
                f"sparse_mode 0: atten_mask keeps scores outside pre_tockens={pre} / next_tockens={nxt}; CANN requires "
                "the band to match the mask (precision problems otherwise)"
            )
        return kept
    if sparse_mode == 1:  # allMask: the full mask, pre/next ignored
        return ~_mask_as_b1ss(atten_mask, sq, sk)
    _check_compressed(atten_mask, sparse_mode)
    if sparse_mode == 2:  # leftUpCausal: "以左上顶点划分的下三角"
        return _band(sq, sk, ALL_TOKENS, 0, 0, device)
    if sparse_mode == 3:  # rightDownCausal: "以右下顶点划分的下三角"
        return _band(sq, sk, ALL_TOKENS, 0, sk - sq, device)
    # band: "计算pre_tockens和next_tockens之间的部分, 参数起点为右下角, pre_tockens和next_tockens之间需要有交集"
    if pre + nxt < 0:
        raise DocumentedMisuse(f"sparse_mode 4: pre_tockens={pre} and next_tockens={nxt} leave an empty band")
    return _band(sq, sk, pre, nxt, sk - sq, device)


def _repeat_groups(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, Nkv, S, D] -> [B, N, S, D]: "Nq/Nkv必须是非0整数" (GQA: query head h reads key head h // (Nq / Nkv))."""
    groups = x.shape[1]
    if groups == 0 or heads % groups:
        raise DocumentedMisuse(f"query heads {heads} not a multiple of key/value heads {groups}")
    return x.repeat_interleave(heads // groups, dim=1)


def _dropout_keep(shape: Sequence[int], keep_prob: float, seed: int, device: torch.device) -> torch.Tensor | None:
    """The dropout mask of (seed): the device's Philox stream cannot be reproduced, its semantics can (a score is
    kept with probability keep_prob and scaled by 1 / keep_prob); the backward regenerates it from the same seed."""
    if keep_prob >= 1.0:
        return None
    if not 0.0 < keep_prob <= 1.0:
        raise DocumentedMisuse(f"keep_prob {keep_prob}: 取值范围为(0, 1]")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.rand(tuple(shape), generator=generator) < keep_prob).to(device)


def _segments(
    qlen: Sequence[int] | None, kvlen: Sequence[int] | None, t_q: int, t_k: int
) -> list[tuple[int, int, int, int]]:
    """TND: (q start, q end, kv start, kv end) per batch from the cumulative lengths ("表示query每个S的累加和长度",
    trailing 0s: batches that take no part)."""
    if qlen is None or kvlen is None:
        raise DocumentedMisuse("input_layout TND needs actual_seq_qlen and actual_seq_kvlen (cumulative lengths)")
    if len(qlen) != len(kvlen):
        raise DocumentedMisuse("actual_seq_qlen and actual_seq_kvlen must have one entry per batch")
    out, q0, k0 = [], 0, 0
    for q1, k1 in zip(qlen, kvlen, strict=True):
        if q1 == 0 and k1 == 0 and (q0 or k0):
            break  # "支持尾部部分Batch不参与计算, 此时actual_seq_qlen和actual_seq_kvlen尾部传入对应个数个0"
        if q1 < q0 or k1 < k0:
            raise DocumentedMisuse("actual_seq_qlen / actual_seq_kvlen must be cumulative (non-decreasing)")
        out.append((q0, q1, k0, k1))
        q0, k0 = q1, k1
    if q0 > t_q or k0 > t_k:
        raise DocumentedMisuse(f"actual_seq_qlen / kvlen end at {q0} / {k0}, beyond T = {t_q} / {t_k}")
    return out


def _attention_bnsd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kept: torch.Tensor | None,
    scale: float,
    keep: torch.Tensor | None,
    keep_prob: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y = Softmax(Mask(scale * q k^T, atten_mask)), attention = Dropout(y) v in fp32 ("Softmax计算的Max中间结果",
    "Sum中间结果": the row max and the row sum of exp(score - max)). Rows with no kept score give 0 (what CANN's
    invalid-row computation, inner_precise 2, is for)."""
    heads = q.shape[1]
    scores = torch.matmul(q.float(), _repeat_groups(k, heads).float().transpose(-1, -2)) * scale
    if kept is not None:
        scores = scores.masked_fill(~kept, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    safe_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - safe_max)
    row_sum = weights.sum(dim=-1, keepdim=True)
    probs = weights / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
    if keep is not None:
        probs = probs * keep / keep_prob
    out = torch.matmul(probs, _repeat_groups(v, heads).float())
    return out, row_max, row_sum


def _stats(t: torch.Tensor) -> torch.Tensor:
    """[..., 1] fp32 -> [..., 8], the kernel's layout of softmax_max / softmax_sum."""
    return t.expand(*t.shape[:-1], STATS_WIDTH).contiguous()


def _unsupported(**given: Any) -> None:
    named = sorted(name for name, value in given.items() if value is not None)
    if named:
        raise NotImplementedError(f"npu_fusion_attention reference: {', '.join(named)} not used by the project")


def fusion_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = ALL_TOKENS,
    next_tockens: int = ALL_TOKENS,
    inner_precise: int = 0,
    prefix: Sequence[int] | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """(attention_out, softmax_max, softmax_sum, softmax_out (reserved, empty), seed, offset, numels), no autograd."""
    _unsupported(pse=pse, padding_mask=padding_mask, prefix=prefix, sink=sink, dropout_mask=dropout_mask)
    if not (query.dtype == key.dtype == value.dtype):
        raise DocumentedMisuse("输入query、key、value的数据类型必须一致")
    if key.shape[:-1] != value.shape[:-1]:
        raise DocumentedMisuse("输入key和value的shape必须一致 (but for D: Dk >= Dv)")
    if input_layout == "TND":
        lengths = (actual_seq_qlen, actual_seq_kvlen)
        band = (pre_tockens, next_tockens)
        return _fusion_attention_tnd(
            query, key, value, head_num, atten_mask, scale, keep_prob, band, lengths, sparse_mode, softmax_layout
        )
    q = _to_bnsd(query, head_num, input_layout)
    head_dim = q.shape[-1]
    kv_heads = _heads_of(key, input_layout, head_dim)
    k = _to_bnsd(key, kv_heads, input_layout)
    if input_layout in ("BSND", "BNSD"):
        v = _to_bnsd(value, kv_heads, input_layout)
    else:
        v = _split_heads(value, kv_heads, value.shape[-1] // kv_heads, input_layout)
    if k.shape[-1] != head_dim or v.shape[-1] > head_dim:
        raise DocumentedMisuse(f"Head Dim必须满足Dq=Dk和Dk≥Dv: Dq={head_dim}, Dk={k.shape[-1]}, Dv={v.shape[-1]}")
    b, _, sq, _ = q.shape
    sk = k.shape[2]
    kept = _kept(sq, sk, atten_mask, sparse_mode, pre_tockens, next_tockens, q.device)
    seed_used = int(torch.randint(0, 2**31 - 1, (1,)).item()) if keep_prob < 1.0 else 0
    keep = _dropout_keep((b, head_num, sq, sk), keep_prob, seed_used, q.device)
    out, row_max, row_sum = _attention_bnsd(q, k, v, kept, scale, keep, keep_prob)
    numels = b * head_num * sq * sk if keep is not None else 0
    empty = query.new_empty(0)
    return _from_bnsd(out.to(query.dtype), input_layout), _stats(row_max), _stats(row_sum), empty, seed_used, 0, numels


def _split_heads(x: torch.Tensor, heads: int, head_dim: int, layout: str) -> torch.Tensor:
    """value of BSH / SBH with its own head size Dv (MLA's "Dk≥Dv") -> [B, N, S, Dv]."""
    if layout == "BSH":
        b, s, _ = x.shape
        return x.view(b, s, heads, head_dim).permute(0, 2, 1, 3)
    s, b, _ = x.shape
    return x.view(s, b, heads, head_dim).permute(1, 2, 0, 3)


def _fusion_attention_tnd(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    atten_mask: torch.Tensor | None,
    scale: float,
    keep_prob: float,
    band: tuple[int, int],
    lengths: tuple[Sequence[int] | None, Sequence[int] | None],
    sparse_mode: int,
    softmax_layout: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """TND (varlen): query [T, N, D]; each batch attends within its own segment, masks in segment coordinates
    ("varlen场景只支持SS格式, SS分别是maxSq和maxSkv"); softmax statistics [N, T, 8] ("默认情况下，softmax的输出排布为NTD")
    or [T, N, 8] with softmax_layout "TND"."""
    if keep_prob < 1.0:
        raise NotImplementedError("npu_fusion_attention reference: dropout under TND is not used by the project")
    if atten_mask is not None and sparse_mode in (0, 1) and atten_mask.dim() != 2:
        raise DocumentedMisuse("varlen场景只支持SS格式 atten_mask")
    out = query.new_zeros(query.shape[0], head_num, value.shape[-1], dtype=torch.float32)
    row_max = torch.full((query.shape[0], head_num, 1), float("-inf"))
    row_sum = torch.zeros(query.shape[0], head_num, 1)
    pre, nxt = band
    for q0, q1, k0, k1 in _segments(*lengths, query.shape[0], key.shape[0]):
        if q1 == q0:
            continue
        q = query[q0:q1].permute(1, 0, 2).unsqueeze(0)
        k = key[k0:k1].permute(1, 0, 2).unsqueeze(0)
        v = value[k0:k1].permute(1, 0, 2).unsqueeze(0)
        mask = atten_mask
        if mask is not None and sparse_mode in (0, 1):
            mask = mask[: q1 - q0, : k1 - k0]
        kept = _kept(q1 - q0, k1 - k0, mask, sparse_mode, pre, nxt, query.device)
        seg_out, seg_max, seg_sum = _attention_bnsd(q, k, v, kept, scale, None, 1.0)
        out[q0:q1] = seg_out[0].permute(1, 0, 2)
        row_max[q0:q1] = seg_max[0].permute(1, 0, 2)
        row_sum[q0:q1] = seg_sum[0].permute(1, 0, 2)
    if softmax_layout not in ("", "TND"):
        raise DocumentedMisuse(f"softmax_layout {softmax_layout!r}: '' or 'TND' (TND only)")
    if softmax_layout == "":
        row_max, row_sum = row_max.transpose(0, 1), row_sum.transpose(0, 1)
    return out.to(query.dtype), _stats(row_max), _stats(row_sum), query.new_empty(0), 0, 0, 0


def fusion_attention_grad(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dy: torch.Tensor,
    head_num: int,
    input_layout: str,
    *,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    softmax_max: torch.Tensor | None = None,
    softmax_sum: torch.Tensor | None = None,
    softmax_in: torch.Tensor | None = None,
    attention_in: torch.Tensor | None = None,
    scale_value: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = ALL_TOKENS,
    next_tockens: int = ALL_TOKENS,
    inner_precise: int = 0,
    seed: int = 0,
    offset: int = 0,
    numels: int = 0,
    prefix: Sequence[int] | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(dq, dk, dv, dpse, dsink) of npu_fusion_attention: the probabilities rebuilt from the forward's softmax_max /
    softmax_sum ("用于反向计算"), D = rowsum(dy * attention_in); dk / dv summed over each key head's query heads."""
    _unsupported(pse=pse, padding_mask=padding_mask, prefix=prefix, sink=sink, softmax_in=softmax_in)
    if input_layout == "TND":
        raise NotImplementedError("npu_fusion_attention_grad reference: TND is not used by the project")
    if softmax_max is None or softmax_sum is None or attention_in is None:
        raise DocumentedMisuse("the backward reads the forward's softmax_max, softmax_sum and attention_in")
    q = _to_bnsd(query, head_num, input_layout).float()
    head_dim = q.shape[-1]
    kv_heads = _heads_of(key, input_layout, head_dim)
    k = _to_bnsd(key, kv_heads, input_layout).float()
    v = _to_bnsd(value, kv_heads, input_layout).float()
    d_out = _to_bnsd(dy, head_num, input_layout).float()
    out = _to_bnsd(attention_in, head_num, input_layout).float()
    b, _, sq, _ = q.shape
    sk = k.shape[2]
    kept = _kept(sq, sk, atten_mask, sparse_mode, pre_tockens, next_tockens, q.device)
    scores = torch.matmul(q, _repeat_groups(k, head_num).transpose(-1, -2)) * scale_value
    probs = torch.exp(scores - softmax_max[..., :1]) / softmax_sum[..., :1]
    if kept is not None:
        probs = probs.masked_fill(~kept, 0.0)
    keep = _dropout_keep((b, head_num, sq, sk), keep_prob, seed, q.device)
    dropped = probs if keep is None else probs * keep / keep_prob
    dv = torch.matmul(dropped.transpose(-1, -2), d_out)
    d_dropped = torch.matmul(d_out, _repeat_groups(v, head_num).transpose(-1, -2))
    d_probs = d_dropped if keep is None else d_dropped * keep / keep_prob
    row_dot = (d_out * out).sum(dim=-1, keepdim=True)
    d_scores = probs * (d_probs - row_dot) * scale_value
    dq = torch.matmul(d_scores, _repeat_groups(k, head_num))
    dk = torch.matmul(d_scores.transpose(-1, -2), q)

    def per_key_head(grad: torch.Tensor) -> torch.Tensor:
        return grad.view(b, kv_heads, head_num // kv_heads, sk, grad.shape[-1]).sum(dim=2)

    dq_out = _from_bnsd(dq.to(query.dtype), input_layout)
    dk_out = _from_bnsd(per_key_head(dk).to(query.dtype), input_layout)
    dv_out = _from_bnsd(per_key_head(dv).to(query.dtype), input_layout)
    return dq_out, dk_out, dv_out, None, query.new_empty(0)


class _FusionAttention(torch.autograd.Function):
    """torch_npu registers npu_fusion_attention with autograd (its backward: the grad kernel); so does this."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, options: dict) -> Any:
        out, row_max, row_sum, reserved, seed, offset, numels = fusion_attention_forward(query, key, value, **options)
        ctx.options, ctx.seed = options, seed
        ctx.save_for_backward(query, key, value, out, row_max, row_sum)
        ctx.mark_non_differentiable(row_max, row_sum, reserved)
        return out, row_max, row_sum, reserved, seed, offset, numels

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor, *_: Any) -> Any:
        query, key, value, out, row_max, row_sum = ctx.saved_tensors
        options = dict(ctx.options)
        head_num, layout = options.pop("head_num"), options.pop("input_layout")
        dq, dk, dv, _, _ = fusion_attention_grad(
            query,
            key,
            value,
            d_out.contiguous(),
            head_num,
            layout,
            atten_mask=options.get("atten_mask"),
            softmax_max=row_max,
            softmax_sum=row_sum,
            attention_in=out,
            scale_value=options.get("scale", 1.0),
            keep_prob=options.get("keep_prob", 1.0),
            pre_tockens=options.get("pre_tockens", ALL_TOKENS),
            next_tockens=options.get("next_tockens", ALL_TOKENS),
            seed=ctx.seed,
            sparse_mode=options.get("sparse_mode", 0),
        )
        return dq, dk, dv, None


def npu_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = ALL_TOKENS,
    next_tockens: int = ALL_TOKENS,
    inner_precise: int = 0,
    prefix: Sequence[int] | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """torch_npu.npu_fusion_attention (parameters and defaults: the wheel's meta registration)."""
    options = {name: value for name, value in locals().items() if name not in ("query", "key", "value")}
    if input_layout == "TND" or not (query.requires_grad or key.requires_grad or value.requires_grad):
        return fusion_attention_forward(query, key, value, **options)
    return _FusionAttention.apply(query, key, value, options)


def npu_fusion_attention_grad(*args: Any, **kwargs: Any) -> tuple:
    """torch_npu.npu_fusion_attention_grad (parameters and defaults: the wheel's meta registration)."""
    return fusion_attention_grad(*args, **kwargs)


npu_fusion_attention_grad.__signature__ = inspect.signature(fusion_attention_grad)  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------------------------------
# npu_ring_attention_update. Source: torch_npu/_op_plugin_docs.py "npu_ring_attention_update" (计算公式) and its meta
# registration (input_layout "SBH" / "TND", input_softmax_layout "", "SBH", "TND"; equal shapes and dtypes).
# ------------------------------------------------------------------------------------------------------------------


def npu_ring_attention_update(
    prev_attn_out: torch.Tensor,
    prev_softmax_max: torch.Tensor,
    prev_softmax_sum: torch.Tensor,
    cur_attn_out: torch.Tensor,
    cur_softmax_max: torch.Tensor,
    cur_softmax_sum: torch.Tensor,
    *,
    actual_seq_qlen: torch.Tensor | None = None,
    input_layout: str = "SBH",
    input_softmax_layout: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """softmax_max = max(prev, cur); softmax_sum = prev_sum * exp(prev_max - max) + cur_sum * exp(cur_max - max);
    attn_out = prev_out * exp(prev_max - max) * prev_sum / sum + cur_out * exp(cur_max - max) * cur_sum / sum.
    SBH: attn_out [S, B, H], statistics [B, N, S, 8] (npu_fusion_attention's)."""
    if input_layout not in ("SBH", "TND"):
        raise DocumentedMisuse(f"input_layout only supports 'SBH' or 'TND', but got {input_layout}")
    if input_softmax_layout not in ("", "SBH", "TND"):
        raise DocumentedMisuse("input_softmax_layout only supports '', 'SBH' or 'TND'")
    if prev_attn_out.shape != cur_attn_out.shape or prev_attn_out.dtype != cur_attn_out.dtype:
        raise DocumentedMisuse("prev_attn_out and cur_attn_out must have the same shape and dtype")
    if not (prev_softmax_max.shape == prev_softmax_sum.shape == cur_softmax_max.shape == cur_softmax_sum.shape):
        raise DocumentedMisuse("softmax tensors must keep the same shape")
    if prev_softmax_max.size(-1) != STATS_WIDTH:
        raise DocumentedMisuse("the softmax statistics' last dimension is 8 (the meta registration checks it)")
    if input_layout == "TND" or input_softmax_layout:
        raise NotImplementedError("npu_ring_attention_update reference: TND / explicit softmax layouts not used")
    softmax_max = torch.maximum(prev_softmax_max, cur_softmax_max)
    prev_part = prev_softmax_sum * torch.exp(prev_softmax_max - softmax_max)
    cur_part = cur_softmax_sum * torch.exp(cur_softmax_max - softmax_max)
    softmax_sum = prev_part + cur_part
    s, b, h = prev_attn_out.shape
    heads = prev_softmax_max.shape[1]

    def per_row(weight: torch.Tensor) -> torch.Tensor:  # [B, N, S, 8] -> [S, B, N, 1] over the output's heads
        return weight[..., :1].permute(2, 0, 1, 3)

    prev = prev_attn_out.float().view(s, b, heads, h // heads)
    cur = cur_attn_out.float().view(s, b, heads, h // heads)
    attn_out = prev * per_row(prev_part / softmax_sum) + cur * per_row(cur_part / softmax_sum)
    return attn_out.reshape(s, b, h).to(prev_attn_out.dtype), softmax_max, softmax_sum


# ------------------------------------------------------------------------------------------------------------------
# npu_grouped_matmul. Source: torch_npu/_op_plugin_docs.py "npu_grouped_matmul" (y_i = x_i x weight_i + bias_i;
# group_list: "group_list_type 0: cumsum ... 1: 每组大小"; split_item 0/1: one output per weight, 2/3: one tensor;
# group_type -1 no grouping, 0 the m axis) and the meta registration (group_type 2: the K axis, output [g, m, n]).
# ------------------------------------------------------------------------------------------------------------------


def _group_bounds(group_list: torch.Tensor | Sequence[int], group_list_type: int | None) -> list[tuple[int, int]]:
    """[start, end) of every group along the grouped axis."""
    if isinstance(group_list, torch.Tensor):
        if group_list.dim() != 1 or group_list.dtype != torch.int64:
            raise DocumentedMisuse("group_list: a 1-d int64 tensor ('数据类型支持torch.int64', '仅支持1维输入')")
        values = [int(v) for v in group_list.tolist()]
        if group_list_type == 1:
            # "当group_list_type为1时, group_list必须为非负数列, 且长度不能为1"
            if len(values) == 1 or any(v < 0 for v in values):
                raise DocumentedMisuse(f"group_list_type 1 (sizes): non-negative and not of length 1, got {values}")
            ends = [sum(values[: i + 1]) for i in range(len(values))]
        elif group_list_type == 0:
            # "当group_list_type为0时, group_list必须为非负单调非递减数列"
            if any(v < 0 for v in values) or any(b < a for a, b in zip(values, values[1:], strict=False)):
                raise DocumentedMisuse(f"group_list_type 0 (cumsum): non-negative, non-decreasing, got {values}")
            ends = values
        else:
            raise DocumentedMisuse(f"group_list_type {group_list_type}: 0 (cumsum) or 1 (sizes)")
    else:
        # "group_list输入类型为List[int]时, 配置值必须为非负递增数列, 且长度不能为1"
        ends = [int(v) for v in group_list]
        if len(ends) == 1 or any(b <= a for a, b in zip(ends, ends[1:], strict=False)) or min(ends) < 0:
            raise DocumentedMisuse(f"group_list as List[int]: increasing, non-negative, not of length 1, got {ends}")
    starts = [0, *ends[:-1]]
    return list(zip(starts, ends, strict=True))


def npu_grouped_matmul(
    x: list[torch.Tensor],
    weight: list[torch.Tensor],
    *,
    bias: list[torch.Tensor] | None = None,
    scale: list[torch.Tensor] | None = None,
    offset: list[torch.Tensor] | None = None,
    antiquant_scale: list[torch.Tensor] | None = None,
    antiquant_offset: list[torch.Tensor] | None = None,
    per_token_scale: list[torch.Tensor] | None = None,
    group_list: torch.Tensor | Sequence[int] | None = None,
    activation_input: list[torch.Tensor] | None = None,
    activation_quant_scale: list[torch.Tensor] | None = None,
    activation_quant_offset: list[torch.Tensor] | None = None,
    split_item: int = 0,
    group_type: int | None = None,
    group_list_type: int = 0,
    act_type: int = 0,
    tuning_config: Sequence[int] | None = None,
    output_dtype: torch.dtype | None = None,
    x_dtype: Any = None,
    weight_dtype: Any = None,
    scale_dtype: Any = None,
    per_token_scale_dtype: Any = None,
) -> list[torch.Tensor]:
    """The non-quantized cases (公式1) the project runs, no autograd (torch_npu registers none for this op):
    single x, weights per group, single output (split_item 2/3); group_type 0 groups x's rows (y_i = x_i w_i),
    group_type 2 groups the shared K axis (y_i = x[:, K_i] w[K_i, :] of one weight, stacked [g, m, n])."""
    quantized = (scale, offset, antiquant_scale, antiquant_offset, per_token_scale, activation_input)
    quantized += (activation_quant_scale, activation_quant_offset, x_dtype, weight_dtype, scale_dtype)
    named = [] if all(value is None for value in (*quantized, per_token_scale_dtype)) else ["quantization"]
    if named or act_type or output_dtype not in (None, x[0].dtype):
        raise NotImplementedError(f"npu_grouped_matmul reference: {named or 'act_type / output_dtype'} not used")
    if not (group_type in (-1, 0, 2) or (isinstance(group_list, list) and group_type is None)):
        raise DocumentedMisuse(f"group_type only supports -1, 0 and 2, but got {group_type}")
    if len(x) != 1 or split_item not in (2, 3) or group_list is None:
        raise NotImplementedError("npu_grouped_matmul reference: the project runs one x, split_item 2/3, a group_list")
    (a,) = x
    if a.dim() != 2 or any(w.dim() != 2 for w in weight):
        raise DocumentedMisuse("单多单: x、weight、y中tensor需为2维")
    if len({w.shape[1] for w in weight}) != 1:
        raise DocumentedMisuse("weight中每个tensor的N轴必须相等")
    bounds = _group_bounds(group_list, group_list_type)
    if group_type == 2:
        # the K axis in groups (meta registration: "In K-split, x is laid out as [K, M]"... output [g, m, n]): x [m, K]
        # and one weight [K, n] share the grouped axis; group i is x[:, K_i] @ weight[K_i, :]
        if len(weight) != 1 or bounds[-1][1] != a.shape[1] or weight[0].shape[0] != a.shape[1]:
            raise DocumentedMisuse(
                f"group_type 2: one weight [K, n] and x [m, K] with group_list ending at K; got x {tuple(a.shape)}, "
                f"{len(weight)} weights, group_list ending at {bounds[-1][1]}"
            )
        parts = [a[:, s:e].float() @ weight[0][s:e].float() for s, e in bounds]
        return [torch.stack(parts).to(a.dtype)]
    if len(bounds) != len(weight):
        raise DocumentedMisuse(f"group_list has {len(bounds)} groups for {len(weight)} weights")
    if bias is not None and len(bias) != len(weight):
        raise DocumentedMisuse("bias: 列表长度与weight列表长度相同")
    # "单多单: 必须传group_list, 且最后一个值与x中tensor的第一维相等"
    if bounds[-1][1] != a.shape[0]:
        raise DocumentedMisuse(f"group_list ends at {bounds[-1][1]}, x has {a.shape[0]} rows")
    rows = []
    for i, ((s, e), w) in enumerate(zip(bounds, weight, strict=True)):
        y = a[s:e].float() @ w.float()
        rows.append(y + bias[i].float() if bias is not None else y)
    return [torch.cat(rows).to(a.dtype)]


# ------------------------------------------------------------------------------------------------------------------
# npu_rms_norm. Source: torch_npu/_op_plugin_docs.py "npu_rms_norm" ((y, rstd): "rms_norm的reverse rms中间结果") and
# the meta registration (rstd fp32, x's leading dims, 1 over gamma's dims).
# ------------------------------------------------------------------------------------------------------------------


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x * rstd * gamma, rstd = 1 / sqrt(mean(x^2 over gamma's dims) + epsilon), computed in fp32."""
    x = self
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or gamma.dtype != x.dtype:
        raise DocumentedMisuse("输入数据类型仅支持float16、bfloat16和float32; gamma的数据类型需要和self保持一致")
    if tuple(x.shape[x.dim() - gamma.dim() :]) != tuple(gamma.shape):
        raise DocumentedMisuse(f"gamma {tuple(gamma.shape)} must be x's trailing dims {tuple(x.shape)}")
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    rstd = torch.rsqrt(x.float().pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (x.float() * rstd * gamma.float()).to(x.dtype), rstd


# ------------------------------------------------------------------------------------------------------------------
# npu_swiglu. Source: torch_npu/_op_plugin_docs.py "npu_swiglu": swiglu(x, dim) = A * sigmoid(A) * B, A and B x's
# halves along dim; the meta registration: the output halves dim.
# ------------------------------------------------------------------------------------------------------------------


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if x.shape[dim] % 2:
        raise DocumentedMisuse(f"npu_swiglu splits dim {dim} in two halves; its size is {x.shape[dim]}")
    a, b = torch.chunk(x, 2, dim=dim)
    return (a.float() * torch.sigmoid(a.float()) * b.float()).to(x.dtype)


# ------------------------------------------------------------------------------------------------------------------
# npu_rotary_mul. Source: torch_npu/_op_plugin_docs.py "npu_rotary_mul": half mode
# x_new = cat(-x2, x1), output = r1 * input + r2 * x_new; interleave mode pairs (x[::2], x[1::2]); input 4-d,
# D even and < 896; r1 / r2 4-d, "数据范围：[-1, 1]", broadcast over the input's layout (11SD, 1S1D, S11D, ...).
# ------------------------------------------------------------------------------------------------------------------


def npu_rotary_mul(
    embedding: torch.Tensor, cosine: torch.Tensor, sine: torch.Tensor, mode: str = "half", rotate: Any = None
) -> torch.Tensor:
    if rotate is not None:
        raise NotImplementedError("npu_rotary_mul reference: rotate is not used by the project")
    if embedding.dim() != 4 or cosine.dim() != 4 or sine.dim() != 4:
        raise DocumentedMisuse("npu_rotary_mul: input, r1 and r2 are 4-d tensors")
    head_dim = embedding.shape[-1]
    if head_dim % 2 or head_dim >= 896:
        raise DocumentedMisuse(f"npu_rotary_mul: D < 896 and a multiple of 2, got {head_dim}")
    for name, r in (("r1", cosine), ("r2", sine)):
        if torch.broadcast_shapes(r.shape, embedding.shape) != embedding.shape or r.shape[-1] != head_dim:
            raise DocumentedMisuse(f"npu_rotary_mul: {name} {tuple(r.shape)} does not broadcast to the input's layout")
        if bool((r.abs() > 1.0 + 1e-6).any()):
            raise DocumentedMisuse(f"npu_rotary_mul: {name} 数据范围：[-1, 1] (cos / sin, not the angles)")
    if mode == "half":
        x1, x2 = torch.chunk(embedding, 2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    elif mode == "interleave":
        x1, x2 = embedding[..., ::2], embedding[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        raise DocumentedMisuse(f"npu_rotary_mul: mode 'half' or 'interleave', got {mode!r}")
    return cosine * embedding + sine * rotated


# ------------------------------------------------------------------------------------------------------------------
# torch.npu: the device calls NpuAccelerator makes (torch_npu/npu/__init__.py's names), mapped onto the host: one
# device per local rank (as torchrun binds LOCAL_RANK to a device), the host RNG, streams that run in issue order.
# ------------------------------------------------------------------------------------------------------------------


def host_npu_namespace() -> types.ModuleType:
    """A ``torch.npu`` whose device is the CPU (what torch_npu registers as ``torch.npu``, emulated)."""
    from megatron_npu.accelerator.cpu import HostEvent, HostStream, _peak_rss_bytes

    npu = types.ModuleType("torch.npu")
    state = {"device": 0, "stream": HostStream()}

    def device_count() -> int:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        return int(local) if local.isdigit() and int(local) > 0 else 1

    def set_device(device: int | str | torch.device) -> None:
        index = device if isinstance(device, int) else torch.device(device).index or 0
        if not 0 <= index < device_count():
            raise RuntimeError(f"npu device {index} out of range ({device_count()} visible)")  # as ACL refuses it
        state["device"] = index

    def rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(new_state)

    def seed(value: int) -> None:
        torch.default_generator.manual_seed(int(value))

    members = {
        "device_count": device_count,
        "current_device": lambda: state["device"],
        "set_device": set_device,
        "get_device_name": lambda device=None: "Ascend910B2 (emulated on the host)",
        "synchronize": lambda device=None: None,
        "Stream": HostStream,
        "Event": HostEvent,
        "current_stream": lambda device=None: state["stream"],
        "default_stream": lambda device=None: state["stream"],
        "stream": lambda stream: contextlib.nullcontext(stream),
        "set_stream": lambda stream: None,
        "get_rng_state": rng_state,
        "set_rng_state": set_rng_state,
        "manual_seed": seed,
        "manual_seed_all": seed,
        "default_generators": _Generators(),
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: _peak_rss_bytes(),
        "memory_reserved": lambda device=None: 0,
        "max_memory_reserved": lambda device=None: _peak_rss_bytes(),
        "memory_stats": lambda device=None: {"max_rss_bytes": _peak_rss_bytes()},
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
        "is_available": lambda: True,
    }
    for name, member in members.items():
        setattr(npu, name, member)
    return npu


class _Generators:
    """torch.npu.default_generators[i]: every emulated device draws from the host generator."""

    def __getitem__(self, index: int) -> torch.Generator:
        return torch.default_generator

    def __len__(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)


#: the operators NpuAccelerator calls, by torch_npu's name
OPERATORS = {
    "npu_fusion_attention": npu_fusion_attention,
    "npu_fusion_attention_grad": npu_fusion_attention_grad,
    "npu_ring_attention_update": npu_ring_attention_update,
    "npu_grouped_matmul": npu_grouped_matmul,
    "npu_rms_norm": npu_rms_norm,
    "npu_swiglu": npu_swiglu,
    "npu_rotary_mul": npu_rotary_mul,
}


def build_torch_npu() -> types.ModuleType:
    """A ``torch_npu`` module of the references: the operators, ``torch_npu.npu`` (also set as ``torch.npu``, as
    importing torch_npu does) and ``torch_npu.profiler`` over torch's own profiler (host activities only)."""
    module = types.ModuleType("torch_npu")
    module.__version__ = "2.14.0+reference"
    for name, operator in OPERATORS.items():
        setattr(module, name, operator)
    module.npu = host_npu_namespace()
    module.profiler = _host_profiler()
    torch.npu = module.npu
    return module


def _host_profiler() -> types.ModuleType:
    """torch_npu.profiler's names NpuAccelerator uses: profile, ProfilerActivity (CPU, NPU), tensorboard_trace_handler."""
    profiler = types.ModuleType("torch_npu.profiler")
    profiler.ProfilerActivity = types.SimpleNamespace(
        CPU=torch.profiler.ProfilerActivity.CPU, NPU=torch.profiler.ProfilerActivity.CPU
    )
    profiler.profile = torch.profiler.profile
    profiler.tensorboard_trace_handler = torch.profiler.tensorboard_trace_handler
    return profiler
