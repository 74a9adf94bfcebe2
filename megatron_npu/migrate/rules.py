"""The migration rules: one row per rule, each with its reason (``megatron-npu migrate --list-rules``).

A rule matches an environment variable (``kind="env"``, exact name or ``PREFIX*``), a
Megatron-LM flag (``kind="flag"``, exact flag or ``--prefix*``; the same rule covers the
``--yaml-cfg`` key spelled with underscores), the entry point or the settings added to a
script. Everything no rule names is copied byte for byte.

Actions:
  rename   env: the variable gets the new name (assignments and references)
  convert  env: renamed and its value converted (NCCL_BUFFSIZE bytes -> HCCL_BUFFSIZE MB)
  comment  env: the assignment is commented out with the reason
  keep     kept unchanged, with a note saying what runs on NPU
  add      env: added (with a ``${VAR:-default}`` default) when the script does not set it
  value    flag: one value is replaced by another (``old=new``)
  remove   flag: removed with its value (YAML: set to false/null)
  refuse   flag: the migration is refused unless --force, which removes it like ``remove``
  entry    the Megatron-LM ``pretrain_gpt.py`` becomes this project's
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    name: str
    kind: str  # "env" | "flag" | "entry"
    match: str  # env name or NAME_* prefix, flag or --prefix*, or "pretrain_gpt.py"
    action: str  # see the module docstring
    to: str = ""  # new name / "old=new" value / added default
    reason: str = ""
    takes_value: bool = False  # flag: a removed flag's value goes with it

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.match)


_TE = "Transformer Engine is CUDA-only; the local spec runs on NPU"
_CUDA_GRAPH = "CUDA graphs do not exist on NPU (torch_npu has no CUDA-graph capture for Megatron)"
_TP_OVERLAP = "TP communication overlap uses TE userbuffers, which are CUDA-only"
_FP8 = "the Ascend 910B has no fp8 arithmetic; refused unless --force, which drops the flag"
_NCCL_ONLY = "NCCL setting with no HCCL equivalent"

RULES: list[Rule] = [
    # ---- environment ------------------------------------------------------------------
    Rule("visible-devices", "env", "CUDA_VISIBLE_DEVICES", "rename", "ASCEND_RT_VISIBLE_DEVICES",
         "NPUs are selected by ASCEND_RT_VISIBLE_DEVICES"),
    Rule("launch-blocking", "env", "CUDA_LAUNCH_BLOCKING", "rename", "ASCEND_LAUNCH_BLOCKING",
         "torch_npu's synchronous-launch switch for debugging"),
    Rule("alloc-conf", "env", "PYTORCH_CUDA_ALLOC_CONF", "rename", "PYTORCH_NPU_ALLOC_CONF",
         "torch_npu's caching allocator reads PYTORCH_NPU_ALLOC_CONF (same expandable_segments syntax)"),
    Rule("max-connections", "env", "CUDA_DEVICE_MAX_CONNECTIONS", "keep", "",
         "Megatron asserts CUDA_DEVICE_MAX_CONNECTIONS=1 when TP/CP>1; NPU scripts keep it"),
    Rule("socket-ifname", "env", "NCCL_SOCKET_IFNAME", "rename", "HCCL_SOCKET_IFNAME",
         "HCCL bootstrap NIC, same ^/= syntax"),
    Rule("buffsize", "env", "NCCL_BUFFSIZE", "convert", "HCCL_BUFFSIZE",
         "HCCL_BUFFSIZE is MB per communicator where NCCL_BUFFSIZE is bytes"),
    Rule("ib-timeout", "env", "NCCL_IB_TIMEOUT", "rename", "HCCL_RDMA_TIMEOUT", "RoCE retransmission timeout"),
    Rule("ib-tc", "env", "NCCL_IB_TC", "rename", "HCCL_RDMA_TC", "RoCE traffic class"),
    Rule("ib-sl", "env", "NCCL_IB_SL", "rename", "HCCL_RDMA_SL", "RoCE service level"),
    Rule("nccl-debug", "env", "NCCL_DEBUG*", "comment", "",
         "NCCL logging; on Ascend use ASCEND_GLOBAL_LOG_LEVEL / ASCEND_SLOG_PRINT_TO_STDOUT"),
    Rule("nccl-other", "env", "NCCL_*", "comment", "", _NCCL_ONLY),
    Rule("torch-nccl", "env", "TORCH_NCCL_*", "comment", "",
         "read by PyTorch's ProcessGroupNCCL only; the HCCL process group ignores it"),
    Rule("nvte", "env", "NVTE_*", "comment", "", "Transformer Engine setting; TE is not used on NPU"),
    Rule("connect-timeout", "env", "HCCL_CONNECT_TIMEOUT", "add", "1200",
         "HCCL link set-up times out after 120 s by default, too short for multi-node start-up"),
    Rule("exec-timeout", "env", "HCCL_EXEC_TIMEOUT", "add", "1836",
         "explicit collective timeout (HCCL's default), the counterpart of NCCL's watchdog"),
    # ---- flags --------------------------------------------------------------------------
    Rule("transformer-impl", "flag", "--transformer-impl", "value", "transformer_engine=local", _TE),
    Rule("backend", "flag", "--distributed-backend", "value", "nccl=hccl", "HCCL is the collective backend on Ascend"),
    Rule("flash-attn", "flag", "--use-flash-attn", "keep", "", "kept: runs as torch_npu.npu_fusion_attention on NPU"),
    Rule("rope-fusion", "flag", "--apply-rope-fusion", "keep", "", "kept: runs as torch_npu.npu_rotary_mul on NPU"),
    Rule("swiglu", "flag", "--swiglu", "keep", "", "kept: the SwiGLU activation runs as torch_npu.npu_swiglu on NPU"),
    Rule("bias-swiglu-fusion", "flag", "--*bias-swiglu-fusion", "keep", "", "kept: runs as torch_npu.npu_swiglu on NPU"),
    Rule("rmsnorm", "flag", "--normalization", "keep", "", "kept: RMSNorm runs as torch_npu.npu_rms_norm on NPU"),
    Rule("grad-acc-fusion", "flag", "--*gradient-accumulation-fusion", "keep", "",
         "kept: pretrain_gpt.py uses apex's CUDA kernel only where it imports; on NPU the same math runs unfused"),
    Rule("masked-softmax-fusion", "flag", "--*masked-softmax-fusion", "keep", "",
         "kept: pretrain_gpt.py uses the CUDA masked-softmax kernel only where it imports; unfused on NPU"),
    Rule("tp-comm-overlap-cfg", "flag", "--tp-comm-overlap-cfg", "remove", "", _TP_OVERLAP, takes_value=True),
    Rule("tp-comm-bootstrap", "flag", "--tp-comm-bootstrap-backend", "remove", "", _TP_OVERLAP, takes_value=True),
    Rule("tp-comm-overlap", "flag", "--tp-comm-*", "remove", "", _TP_OVERLAP),
    Rule("tp-comm-options", "flag", "--disable-tp-comm-*", "remove", "", _TP_OVERLAP),
    Rule("cuda-graph-scope", "flag", "--cuda-graph-scope", "remove", "", _CUDA_GRAPH, takes_value=True),
    Rule("cuda-graph-impl", "flag", "--cuda-graph-impl", "remove", "", _CUDA_GRAPH, takes_value=True),
    Rule("cuda-graph-warmup", "flag", "--cuda-graph-warmup-steps", "remove", "", _CUDA_GRAPH, takes_value=True),
    Rule("cuda-graph", "flag", "--enable-cuda-graph", "remove", "", _CUDA_GRAPH),
    Rule("external-cuda-graph", "flag", "--external-cuda-graph", "remove", "", _CUDA_GRAPH),
    Rule("te-rng-tracker", "flag", "--te-rng-tracker", "remove", "", "Transformer Engine RNG tracker; " + _TE),
    Rule("fp8-valued", "flag", "--fp8-format", "refuse", "", _FP8, takes_value=True),
    Rule("fp8-recipe", "flag", "--fp8-recipe", "refuse", "", _FP8, takes_value=True),
    Rule("fp8-margin", "flag", "--fp8-margin", "refuse", "", _FP8, takes_value=True),
    Rule("fp8-interval", "flag", "--fp8-interval", "refuse", "", _FP8, takes_value=True),
    Rule("fp8-amax", "flag", "--fp8-amax-*", "refuse", "", _FP8, takes_value=True),
    Rule("fp8-bf16-layers", "flag", "--num-layers-at-*-in-bf16", "refuse", "", _FP8, takes_value=True),
    Rule("fp8-first-last-bf16", "flag", "--first-last-layers-bf16", "refuse", "", _FP8),
    Rule("fp8", "flag", "--fp8*", "refuse", "", _FP8),
    Rule("no-fp8-wgrad", "flag", "--no-fp8-wgrad", "refuse", "", _FP8),
    Rule("fp4-valued", "flag", "--fp4-format", "refuse", "", "the 910B has no fp4 either", takes_value=True),
    Rule("fp4", "flag", "--fp4*", "refuse", "", "the 910B has no fp4 either"),
    # ---- entry point --------------------------------------------------------------------
    Rule("entry", "entry", "pretrain_gpt.py", "entry", "${MEGATRON_NPU_DIR}/pretrain_gpt.py",
         "this project's Megatron-LM-compatible trainer; MEGATRON_NPU_DIR (added with a default of "
         "this checkout) says where it lives"),
    Rule("npu-dir", "entry", "MEGATRON_NPU_DIR", "add", "<--megatron-npu-dir, default: this checkout>",
         "where this project's pretrain_gpt.py lives; added (overridable from the environment) when the entry "
         "point was rewritten and the script does not set it"),
    Rule("added-header", "entry", "# megatron-npu migrate: ...", "add", "",
         "a comment line that marks the settings the migration added"),
]

ENV_RULES = [r for r in RULES if r.kind == "env"]
FLAG_RULES = [r for r in RULES if r.kind == "flag"]
ENTRY_RULE = next(r for r in RULES if r.name == "entry")
NPU_DIR_RULE = next(r for r in RULES if r.name == "npu-dir")
HEADER_RULE = next(r for r in RULES if r.name == "added-header")


def env_rule(name: str) -> Rule | None:
    return next((r for r in ENV_RULES if r.action != "add" and r.matches(name)), None)


def flag_rule(flag: str) -> Rule | None:
    """The rule for ``--flag`` (first match wins: exact rows precede prefix rows)."""
    return next((r for r in FLAG_RULES if r.matches(flag)), None)


def yaml_key_rule(key: str) -> Rule | None:
    return flag_rule("--" + key.replace("_", "-"))


def format_rules() -> str:
    width = max(len(r.name) for r in RULES)
    mwidth = max(len(r.match) for r in RULES)
    out = [f"{'rule'.ljust(width)}  {'kind':5} {'action':7} {'match'.ljust(mwidth)}  to / reason"]
    for r in RULES:
        to = f"-> {r.to}; " if r.to else ""
        out.append(f"{r.name.ljust(width)}  {r.kind:5} {r.action:7} {r.match.ljust(mwidth)}  {to}{r.reason}")
    return "\n".join(out)
