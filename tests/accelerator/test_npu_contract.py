"""The npu target against the real torch_npu wheel it is tested with (TESTED_TORCH_NPU), read but never imported.

Every ``torch.npu.X`` the NpuAccelerator calls (``self._npu.X``) and every torch_npu
fused op it names must exist in the wheel's Python sources. The names are found by
scanning our own source, so a newly used symbol is checked automatically.
"""

import ast
import zipfile
from pathlib import Path

import pytest

from megatron_npu.accelerator.facts import TESTED_TORCH_NPU

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(torch_npu_wheel: zipfile.ZipFile) -> zipfile.ZipFile:
    """The wheel, fetched by the suite's set-up step (tests/torch_npu_wheel.py, tests/conftest.py)."""
    return torch_npu_wheel


def module_names(wheel: zipfile.ZipFile, path: str) -> set[str]:
    """Names a module defines: functions, classes, assignments, imports and __all__."""
    tree = ast.parse(wheel.read(path).decode())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names.add(target.id)
                if isinstance(target, ast.Name) and target.id == "__all__" and isinstance(node.value, ast.List):
                    names |= {elt.value for elt in node.value.elts if isinstance(elt, ast.Constant)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def npu_attributes_used(*owner: str) -> set[str]:
    """Every X of ``self.<owner>.X`` in the npu accelerator: ``("_npu",)`` for torch.npu,
    ``("_torch_npu", "profiler")`` for torch_npu's profiler."""
    tree = ast.parse((ROOT / "megatron_npu" / "accelerator" / "npu.py").read_text())
    found = set()
    for node in ast.walk(tree):
        value = node.value if isinstance(node, ast.Attribute) else None
        for name in reversed(owner):
            value = value.value if isinstance(value, ast.Attribute) and value.attr == name else None
        if value is not None:
            found.add(node.attr)
    return found


def fused_ops_named() -> set[str]:
    """The torch_npu op names NpuAccelerator.fused_ops() maps to."""
    tree = ast.parse((ROOT / "megatron_npu" / "accelerator" / "npu.py").read_text())
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("npu_")
    }


def registered_ops(wheel: zipfile.ZipFile) -> dict[str, list[str]]:
    """torch_npu's fused ops with their argument names, from the meta registrations."""
    tree = ast.parse(wheel.read("torch_npu/op_plugin/meta/_meta_registrations.py").decode())
    ops: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            if (
                isinstance(decorator, ast.Call)
                and len(decorator.args) >= 2
                and isinstance(decorator.args[1], ast.Constant)
            ):
                arguments = [a.arg for a in node.args.args + node.args.kwonlyargs]
                ops[decorator.args[1].value] = arguments
    return ops


def test_every_torch_npu_namespace_symbol_we_call_exists(wheel):
    used = npu_attributes_used("_npu")
    assert {"current_device", "set_device", "synchronize", "get_rng_state", "manual_seed"} <= used
    available = module_names(wheel, "torch_npu/npu/__init__.py")
    missing = sorted(used - available)
    assert not missing, f"torch.npu has no {missing} in torch_npu {TESTED_TORCH_NPU}"


def test_every_fused_op_we_name_exists_with_the_documented_arguments(wheel):
    ops = registered_ops(wheel)
    named = fused_ops_named()
    assert named == {
        "npu_fusion_attention",
        "npu_rms_norm",
        "npu_swiglu",
        "npu_rotary_mul",
        "npu_grouped_matmul",
        "npu_fusion_attention_grad",
        "npu_ring_attention_update",
    }
    assert not sorted(named - set(ops)), f"fused op missing from torch_npu {TESTED_TORCH_NPU}"
    assert ops["npu_fusion_attention"][:5] == ["query", "key", "value", "head_num", "input_layout"]
    assert {"atten_mask", "scale", "keep_prob", "pre_tockens", "next_tockens", "sparse_mode"} <= set(
        ops["npu_fusion_attention"]
    )
    # NpuAccelerator._fused_*: npu_rms_norm(x, weight, epsilon=eps), npu_swiglu(x, dim=-1), npu_rotary_mul(t, cos, sin)
    assert ops["npu_rms_norm"][1:] == ["gamma", "epsilon"]
    assert ops["npu_swiglu"] == ["x", "dim"]
    assert ops["npu_rotary_mul"][:4] == ["embedding", "cosine", "sine", "mode"]  # mode defaults to 'half'
    assert "mode='half'" in wheel.read("torch_npu/op_plugin/meta/_meta_registrations.py").decode()
    # npu_grouped_matmul([x], weights, group_list=, split_item=, group_type=, group_list_type=)
    assert ops["npu_grouped_matmul"][:2] == ["x", "weight"]
    assert {"group_list", "split_item", "group_type", "group_list_type"} <= set(ops["npu_grouped_matmul"])


def test_the_grouped_matmul_we_call_takes_our_grouping_and_has_no_autograd_of_its_own(wheel):
    """NpuAccelerator groups rows (group_type 0, forward and dx) and the K axis (group_type 2, the
    weight gradients) with counts as a tensor (group_list_type 1; one group cumulative, type 0); it
    writes the backward itself because torch_npu 2.14.0 registers no autograd formula for the op."""
    meta = wheel.read("torch_npu/op_plugin/meta/_meta_registrations.py").decode()
    assert "group_type == -1 or group_type == 0 or group_type == 2" in meta
    functions = wheel.read("torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml").decode()
    autograd = functions.split("\nbackend:", 1)[0]
    assert autograd.startswith("autograd:") and "npu_grouped_matmul" not in autograd
    # the overload of a Tensor group_list (ours: counts on the device) is the one with group_list_type
    (schema,) = [line for line in functions.splitlines() if line.startswith("  func: npu_grouped_matmul(")]
    assert "Tensor? group_list=None" in schema and "int? group_list_type=0" in schema
    grouping = {"group_list", "split_item", "group_type", "group_list_type"}
    assert fused_op_calls()["npu_grouped_matmul"] == [(2, grouping), (2, grouping)]


def fused_op_calls() -> dict[str, list[tuple[int, set[str]]]]:
    """Every ``self._torch_npu.npu_*(...)`` call in the npu accelerator: (positional count, keywords)."""
    tree = ast.parse((ROOT / "megatron_npu" / "accelerator" / "npu.py").read_text())
    calls: dict[str, list[tuple[int, set[str]]]] = {}
    for node in ast.walk(tree):
        func = node.func if isinstance(node, ast.Call) else None
        if (
            isinstance(func, ast.Attribute)
            and func.attr.startswith("npu_")
            and isinstance(func.value, ast.Attribute)
            and func.value.attr == "_torch_npu"
        ):
            calls.setdefault(func.attr, []).append((len(node.args), {k.arg for k in node.keywords}))
    return calls


def test_every_fused_op_call_passes_arguments_the_wheel_accepts(wheel):
    """torch_npu's calling conventions live in NpuAccelerator._fused_*; each call must fit the op."""
    ops = registered_ops(wheel)
    calls = fused_op_calls()
    assert set(calls) == fused_ops_named()  # every kernel fused_ops() reports is called behind a neutral signature
    for op, uses in calls.items():
        for positional, keywords in uses:
            assert positional <= len(ops[op]), f"{op}: {positional} positional arguments, the op takes {ops[op]}"
            assert keywords <= set(ops[op][positional:]), f"{op}: {sorted(keywords)} not among {ops[op]}"


def test_fused_kernels_keep_the_neutral_signatures_of_accelerator_fused_kernel():
    import inspect

    from megatron_npu.accelerator import npu

    expected = {
        "rms_norm": ["x", "weight", "eps"],
        "swiglu": ["x"],
        "rotary": ["t", "cos", "sin"],
        "flash_attention": ["query", "key", "value", "softmax_scale", "dropout_p", "attention_mask", "window"],
        "grouped_matmul": ["x", "weights", "tokens_per_expert"],
        "attention_block": ["query", "key", "value", "softmax_scale", "causal", "band"],
        "attention_block_grad": [
            "query",
            "key",
            "value",
            "dout",
            "out",
            "softmax_max",
            "softmax_sum",
            "softmax_scale",
            "causal",
            "band",
        ],
        "attention_merge": ["out", "softmax_max", "softmax_sum", "block_out", "block_max", "block_sum"],
    }
    assert set(expected) == set(npu._FUSED_KERNELS)
    for key, params in expected.items():
        method = getattr(npu.NpuAccelerator, f"_fused_{key}")
        assert list(inspect.signature(method).parameters)[1:] == params


def test_the_hccl_backend_is_registered_by_the_wheel(wheel):
    sources = [name for name in wheel.namelist() if name.startswith("torch_npu/") and name.endswith(".py")]
    assert any(
        b'"hccl"' in wheel.read(name) or b"'hccl'" in wheel.read(name) for name in sources if "distributed" in name
    )


def classes(wheel: zipfile.ZipFile, path: str) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in ast.parse(wheel.read(path).decode()).body if isinstance(node, ast.ClassDef)}


def methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}


def test_the_profiler_we_start_on_npu_exists_with_chrome_export(wheel):
    used = npu_attributes_used("_torch_npu", "profiler")
    assert used == {"profile", "ProfilerActivity", "tensorboard_trace_handler"}
    assert used <= module_names(wheel, "torch_npu/profiler/__init__.py")
    found = classes(wheel, "torch_npu/profiler/profiler.py")
    profile = found["profile"]
    # --profile with a log dir: on_trace_ready=tensorboard_trace_handler(dir, worker_name=...), the writer of
    # the per-rank *_ascend_pt output MindStudio Insight reads
    assert "on_trace_ready" in [a.arg for a in methods(profile)["__init__"].args.kwonlyargs]
    handler = next(
        node
        for node in ast.parse(wheel.read("torch_npu/profiler/profiler.py").decode()).body
        if isinstance(node, ast.FunctionDef) and node.name == "tensorboard_trace_handler"
    )
    assert [a.arg for a in handler.args.args][:2] == ["dir_name", "worker_name"]
    # StepProfiler: with-block (__enter__/__exit__), then export_chrome_trace(path)
    assert {"__enter__", "__exit__"} <= methods(profile).keys()
    assert [b.id for b in profile.bases if isinstance(b, ast.Name)] == ["_KinetoProfile"]
    assert "export_chrome_trace" in methods(found["_KinetoProfile"])
    assert "activities" in [a.arg for a in methods(profile)["__init__"].args.kwonlyargs]
    # ProfilerActivity is compiled (torch_npu._C._profiler); torch_npu's own Python uses both members
    interface = wheel.read("torch_npu/profiler/profiler_interface.py").decode()
    assert "ProfilerActivity.CPU" in interface and "ProfilerActivity.NPU" in interface


def _meta_function(wheel: zipfile.ZipFile, op: str) -> ast.FunctionDef:
    """The meta registration of ``op`` (its Python stand-in: arguments, output shapes)."""
    tree = ast.parse(wheel.read("torch_npu/op_plugin/meta/_meta_registrations.py").decode())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(
            isinstance(d, ast.Call) and len(d.args) >= 2 and getattr(d.args[1], "value", None) == op
            for d in node.decorator_list
        ):
            return node
    raise AssertionError(f"torch_npu {TESTED_TORCH_NPU} registers no meta function for {op}")


def _returned_names(function: ast.FunctionDef) -> list[list[str]]:
    """The names (or source) of every tuple the function returns."""
    found = []
    for node in ast.walk(function):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
            found.append([ast.unparse(element) for element in node.value.elts])
    return found


def test_context_parallel_blocks_take_the_softmax_statistics_the_wheel_returns(wheel):
    """Ring attention (ops/cp_ring.py) on Ascend: npu_fusion_attention's outputs 1 and 2 are
    softmax_max / softmax_sum, fp32 [B, N, S, 8]; npu_fusion_attention_grad takes them back with the
    output (attention_in) and returns dq, dk, dv first; npu_ring_attention_update merges two partial
    results in SBH with those statistics. torch_npu exposes every torch.ops.npu op as torch_npu.<op>,
    so fused_ops() finds each by attribute: where an older torch_npu lacks the merge, the accelerator
    answers None and the torch merge runs (on statistics of any last dimension)."""
    forward = _meta_function(wheel, "npu_fusion_attention")
    assert _returned_names(forward)[-1][:3] == ["attention_score", "softmax_max", "softmax_sum"]
    source = ast.unparse(forward)
    assert "softmax_max = torch.empty([B, head_num, S1, 8], dtype=torch.float32" in source
    backward = _meta_function(wheel, "npu_fusion_attention_grad")
    assert _returned_names(backward) == [["dq", "dk", "dv", "dpse", "dsink"]]
    assert {"softmax_max", "softmax_sum", "attention_in", "scale_value"} <= {a.arg for a in backward.args.kwonlyargs}
    merge = _meta_function(wheel, "npu_ring_attention_update")
    assert [a.arg for a in merge.args.args] == [
        "prev_attn_out",
        "prev_softmax_max",
        "prev_softmax_sum",
        "cur_attn_out",
        "cur_softmax_max",
        "cur_softmax_sum",
    ]
    assert "input_layout in ('SBH', 'TND')" in ast.unparse(merge)
    assert "prev_softmax_max.size(-1) == 8" in ast.unparse(merge)
    # all three are ops of the torch.ops.npu namespace, which torch_npu/_init/core/_exports.py copies onto torch_npu
    functions = wheel.read("torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml").decode()
    for op in ("npu_fusion_attention", "npu_fusion_attention_grad", "npu_ring_attention_update"):
        assert f"func: {op}(" in functions
    exports = wheel.read("torch_npu/_init/core/_exports.py").decode()
    assert (
        "for name in dir(torch.ops.npu):" in exports and "globals_dict[name] = getattr(torch.ops.npu, name)" in exports
    )
    calls = fused_op_calls()
    assert calls["npu_ring_attention_update"] == [(6, {"input_layout"})]
    # the block's mask: causal, none, or a window's band (sparse_mode 4 with pre / next tockens)
    cp_keywords = {"atten_mask", "scale", "keep_prob", "pre_tockens", "next_tockens", "sparse_mode"}
    assert (5, cp_keywords) in calls["npu_fusion_attention"]
    grad_keywords = {
        "atten_mask",
        "softmax_max",
        "softmax_sum",
        "attention_in",
        "scale_value",
        "keep_prob",
        "pre_tockens",
        "next_tockens",
        "sparse_mode",
    }
    assert calls["npu_fusion_attention_grad"] == [(6, grad_keywords)]
