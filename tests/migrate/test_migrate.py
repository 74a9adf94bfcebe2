"""megatron-npu migrate: Megatron-LM launch scripts and --yaml-cfg files -> NPU.

Fixtures (tests/fixtures/migrate/) follow public Megatron-LM examples: a GPT-3 175B
multi-node script with bash arrays, a LLaMA-2 style script with string arguments and
``python -m torch.distributed.launch``, an fp8 script and a --yaml-cfg file. For each:
the expected changes, every other value kept (only the reported lines differ), bash -n /
yaml.safe_load, idempotence, and the migrated arguments parse with pretrain_gpt.py's parser.
"""

from __future__ import annotations

import difflib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from megatron_npu.migrate import cli
from megatron_npu.migrate.bash_parse import find_launch
from megatron_npu.migrate.rules import RULES, flag_rule

# every test here runs bash -n on a migrated script (and some run the script)
pytestmark = pytest.mark.launch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "migrate"
NPU_DIR = "/opt/megatron-npu"


def run(tmp_path: Path, name: str, *extra: str, src: Path | None = None) -> tuple[int, str, dict, Path]:
    src = src or FIXTURES / name
    out = tmp_path / f"out{src.suffix}"
    report = tmp_path / "report.json"
    for p in (out, report):
        p.unlink(missing_ok=True)
    rc = cli.main([str(src), "-o", str(out), "--report", str(report), "--megatron-npu-dir", NPU_DIR, *extra])
    return rc, src.read_text(), json.loads(report.read_text()), out


def assert_only_reported_lines_change(src: str, out: str, report: dict) -> None:
    a, b = src.split("\n"), out.split("\n")
    changed, inserted = set(), []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag in ("replace", "delete"):
            changed.update(range(i1 + 1, i2 + 1))
        if tag in ("replace", "insert"):
            inserted += b[j1:j2]
    assert changed == {c["line"] for c in report["changes"] if c["before"] is not None}
    afters = [c["after"] for c in report["changes"] if c["after"] is not None]
    assert all(line in afters for line in inserted), set(inserted) - set(afters)
    for c in report["changes"]:
        if c["before"] is not None:
            assert a[c["line"] - 1] == c["before"]
        assert c["rule"] and c["reason"]


def untouched(args: list[str]) -> list[str]:
    """The arguments no rule touches (removed/changed flags and their values taken out)."""
    out, skip = [], False
    for i, tok in enumerate(args):
        if skip:
            skip = False
            continue
        rule = flag_rule(tok.split("=", 1)[0]) if tok.startswith("--") else None
        if rule is None or rule.action == "keep":
            out.append(tok)
            continue
        skip = "=" not in tok and (rule.takes_value or rule.action == "value") and i + 1 < len(args)
    return out


def bash_n(path: Path) -> None:
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def parse_trainer_args(argv: list[str], world_size: int):
    arguments = pytest.importorskip("megatron_npu.training.arguments")
    return arguments.parse_args(argv, world_size=world_size, check_paths=False)


def rules_of(report: dict) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for c in report["changes"]:
        out.setdefault(c["line"], set()).add(c["rule"])
    return out


# ---------------------------------------------------------------------------------------


def test_list_rules(capsys):
    assert cli.main(["--list-rules"]) == 0
    text = capsys.readouterr().out
    names = [r.name for r in RULES]
    assert len(names) == len(set(names))
    for r in RULES:
        assert r.name in text and r.reason and r.reason in text


EXPECTED_BASH = {
    "gpt3_175b_distributed.sh": {
        6: {"visible-devices"},
        7: {"socket-ifname"},
        8: {"ib-timeout"},
        9: {"nccl-other"},
        10: {"nccl-debug"},
        11: {"buffsize"},
        12: {"nvte"},
        13: {"alloc-conf", "npu-dir", "added-header"},
        44: {"transformer-impl"},
        72: {"tp-comm-overlap"},
        75: {"backend"},
        93: {"cuda-graph"},
        94: {"cuda-graph-scope"},
        97: {"entry"},
    },
    "llama2_7b_string_args.sh": {
        7: {"nccl-other"},
        8: {"torch-nccl", "npu-dir", "added-header"},
        43: {"transformer-impl"},
        57: {"tp-comm-overlap"},
        72: {"entry"},
        76: {"backend"},
    },
}


@pytest.mark.parametrize("name", sorted(EXPECTED_BASH))
def test_bash_fixture(tmp_path, name):
    rc, src, report, out = run(tmp_path, name)
    assert rc == 0, report
    assert report["verdict"] == "ok", report
    assert rules_of(report) == EXPECTED_BASH[name]
    text = out.read_text()
    assert_only_reported_lines_change(src, text, report)
    bash_n(out)
    assert report["checks"]["syntax"] == "ok" and report["checks"]["layout"] == "ok"
    # the launch: same launcher, the project's entry point, every untouched value kept in order
    before, after = find_launch(src), find_launch(text)
    assert before.launcher == after.launcher
    assert after.entry == f"{NPU_DIR}/pretrain_gpt.py"
    assert untouched(before.args) == untouched(after.args)
    for gone in ("--tp-comm-overlap", "--enable-cuda-graph", "--cuda-graph-scope", "transformer_engine", "nccl"):
        assert gone not in after.args
    # idempotent: the migrated script migrates to itself
    again = cli.migrate_text(text, "bash", npu_dir=NPU_DIR)
    assert again.result.changes == [] and again.result.text == text


def test_gpt3_values_and_parse(tmp_path):
    rc, src, report, out = run(tmp_path, "gpt3_175b_distributed.sh")
    text = out.read_text()
    for kept in (
        "export CUDA_DEVICE_MAX_CONNECTIONS=1",
        "NUM_NODES=16",
        "    --num-layers 96",
        "    --rampup-batch-size 16 16 5859375",
        "\t--tensor-model-parallel-size 8",
        "\t--pipeline-model-parallel-size 16",
        "    --save $CHECKPOINT_PATH",
        "    --split 949,50,1",
        "export HCCL_BUFFSIZE=8",
        "export HCCL_SOCKET_IFNAME=eth0",
        "    --use-flash-attn",
        "    --no-masked-softmax-fusion",
        f"MEGATRON_NPU_DIR=${{MEGATRON_NPU_DIR:-{NPU_DIR}}}",
    ):
        assert kept in text.split("\n"), kept
    assert "# export NCCL_IB_DISABLE=0 # use InfiniBand  # megatron-npu migrate:" in text
    assert report["layout"] == {
        "tp": 8,
        "pp": 16,
        "cp": 1,
        "ep": 1,
        "vpp": None,
        "nnodes": 16,
        "nproc_per_node": 8,
        "npus_per_node": 8,
        "world_size": 128,
        "dp": 1,
    }
    notes = {n["item"] for n in report["notes"]}
    assert {"--use-flash-attn", "--no-masked-softmax-fusion", "CUDA_DEVICE_MAX_CONNECTIONS"} <= notes
    launch = find_launch(text)
    args = parse_trainer_args(launch.args, world_size=128)
    assert (args.num_layers, args.hidden_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (
        96,
        12288,
        8,
        16,
    )
    assert args.transformer_impl == "local" and args.distributed_backend == "hccl"
    assert args.global_batch_size == 1536 and args.save == "$1"  # unresolved positional stays literal


def test_llama_values_and_parse(tmp_path):
    rc, src, report, out = run(tmp_path, "llama2_7b_string_args.sh")
    text = out.read_text()
    assert "python -m torch.distributed.launch $DISTRIBUTED_ARGS \\" in text  # launcher kept
    assert '    --no-gradient-accumulation-fusion \\\n    "\n' in text  # string closed where --tp-comm-overlap was
    assert "    --distributed-backend hccl 2>&1 | tee logs/llama2_7b.log" in text
    notes = {n["item"] for n in report["notes"]}
    assert {"--normalization RMSNorm", "--swiglu", "--apply-rope-fusion", "--use-flash-attn"} <= notes
    launch = find_launch(text)
    assert launch.launcher_value("--nproc_per_node") == "8" and "--group-query-attention" in launch.args
    args = parse_trainer_args(launch.args, world_size=8)
    assert (args.num_layers, args.num_query_groups, args.ffn_hidden_size, args.seq_length) == (32, 8, 11008, 4096)
    assert args.normalization == "RMSNorm" and args.swiglu and args.position_embedding_type == "rope"
    assert args.transformer_impl == "local" and args.tokenizer_model == "/data/llama/tokenizer.model"


def test_fp8_refused_then_forced(tmp_path, capsys):
    rc, src, report, out = run(tmp_path, "gpt_fp8.sh")
    err = capsys.readouterr().err
    assert rc == 1 and report["verdict"] == "refused" and not out.exists()
    assert "fp8" in err and "--fp8-format hybrid" in err and "--fp8-param-gather" in err and "--force" in err
    assert {f["item"] for f in report["refused"]} == {
        "--fp8-format hybrid",
        "--fp8-amax-history-len 1024",
        "--fp8-amax-compute-algo max",
        "--fp8-param-gather",
    }
    rc, src, report, out = run(tmp_path, "gpt_fp8.sh", "--force")
    assert rc == 0 and report["verdict"] == "ok-with-warnings"
    assert len(report["forced"]) == 4 and report["refused"] == []
    text = out.read_text()
    assert "fp8" not in text.replace("gpt_fp8", "").split("ARGS=(")[1]
    assert_only_reported_lines_change(src, text, report)
    bash_n(out)
    launch = find_launch(text)
    assert untouched(find_launch(src).args) == untouched(launch.args)
    args = parse_trainer_args(launch.args, world_size=1)
    assert args.bf16 and args.num_layers == 32 and args.global_batch_size == 128
    assert cli.migrate_text(text, "bash", npu_dir=NPU_DIR).result.changes == []


def test_yaml_fixture(tmp_path):
    rc, src, report, out = run(tmp_path, "gpt_config.yaml")
    assert rc == 0 and report["verdict"] == "ok", report
    text = out.read_text()
    assert_only_reported_lines_change(src, text, report)
    assert {c["rule"] for c in report["changes"]} == {
        "fp8-margin",
        "fp8-interval",
        "fp8-amax",
        "fp8",
        "tp-comm-overlap",
        "transformer-impl",
        "tp-comm-overlap-cfg",
        "backend",
    }
    assert "  tp_comm_overlap: False # TE userbuffers" in text
    assert "distributed_backend: hccl   # NCCL everywhere" in text
    assert text.startswith("# WARNING: Yaml configs is currently an experimental feature\n")
    before, after = yaml.safe_load(src), yaml.safe_load(text)
    changed = {
        "fp8_margin",
        "fp8_interval",
        "fp8_amax_history_len",
        "fp8_amax_compute_algo",
        "fp8_wgrad",
        "tp_comm_overlap",
        "transformer_impl",
        "tp_comm_overlap_cfg",
        "distributed_backend",
    }

    def flat(doc):
        return {k: v for k, v in cli_flatten(doc).items() if k not in changed}

    assert flat(before) == flat(after)
    assert cli_flatten(after)["transformer_impl"] == "local"
    assert cli.migrate_text(text, "yaml").result.changes == []
    args = parse_trainer_args(["--yaml-cfg", str(out)], world_size=8)
    assert (args.num_layers, args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (24, 4, 2)
    assert args.seq_length == 4096 and args.micro_batch_size == 2


def cli_flatten(doc):
    from megatron_npu.migrate.yamlcfg import flatten

    return flatten(doc)


def test_yaml_fp8_refused(tmp_path):
    src = tmp_path / "fp8.yaml"
    src.write_text("language_model:\n  num_layers: 4\n  fp8: hybrid  # Hopper\n  fp8_margin: 0\n")
    rc = cli.main([str(src), "-o", str(tmp_path / "o.yaml")])
    assert rc == 1 and not (tmp_path / "o.yaml").exists()
    # --force drops fp8 and writes the file; it still would not start (no hidden size): exit 1, named
    assert cli.main([str(src), "-o", str(tmp_path / "o.yaml"), "--force"]) == 1
    assert (
        tmp_path / "o.yaml"
    ).read_text() == "language_model:\n  num_layers: 4\n  fp8: null  # Hopper\n  fp8_margin: null\n"


def test_layout_refused(tmp_path, capsys):
    text = (
        (FIXTURES / "llama2_7b_string_args.sh")
        .read_text()
        .replace("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 16")
    )
    rep = cli.migrate_text(text, "bash", npu_dir=NPU_DIR)
    assert rep.verdict == "refused" and "TP=16" in rep.checks["layout"]
    src = tmp_path / "t.sh"
    src.write_text((FIXTURES / "llama2_7b_string_args.sh").read_text())
    assert cli.main([str(src), "--npus-per-node", "4", "-o", str(tmp_path / "o.sh")]) == 1
    assert "8 processes per node" in capsys.readouterr().err
    rep = cli.migrate_text(
        text.replace("GPUS_PER_NODE=8", "GPUS_PER_NODE=$NPUS"), "bash", npu_dir=NPU_DIR, npus_per_node=16
    )
    assert rep.layout["nproc_per_node"] == 16  # unresolved: --npus-per-node assumed, with a warning
    assert any("nproc_per_node=$NPUS" in f.item for f in rep.result.unsupported)


def test_edge_cases(tmp_path):
    text = (
        "#!/bin/bash\n"
        "NCCL_DEBUG=INFO CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node=2 pretrain_gpt.py \\\n"
        "    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 \\\n"
        "    --max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 2 --train-iters 5 \\\n"
        "    --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 \\\n"
        "    --transformer-impl=transformer_engine --fp8-format=hybrid \\\n"
        "    --tp-comm-overlap\n"
        "echo done  # --tp-comm-overlap in a comment stays\n"
    )
    rep = cli.migrate_text(text, "bash", npu_dir=NPU_DIR, force=True)
    out = rep.result.text.split("\n")
    assert "CUDA_VISIBLE_DEVICES" not in rep.result.text and "NCCL_DEBUG" not in rep.result.text
    assert "ASCEND_RT_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node=2 ${MEGATRON_NPU_DIR}/pretrain_gpt.py \\" in out
    assert "    --transformer-impl=local \\" in out
    assert out[-3:] == ["", "echo done  # --tp-comm-overlap in a comment stays", ""]
    assert cli.bash_syntax(rep.result.text) is None and rep.checks["syntax"] == "ok"
    assert rep.layout["world_size"] == 2 and rep.verdict == "ok-with-warnings"  # forced fp8 is a warning
    assert cli.migrate_text(rep.result.text, "bash", npu_dir=NPU_DIR).result.changes == []


def test_native_script_unchanged():
    text = (
        "#!/bin/bash\nexport HCCL_CONNECT_TIMEOUT=1800\nexport HCCL_EXEC_TIMEOUT=1836\n"
        "MEGATRON_NPU_DIR=/opt/x\n"
        "python ${MEGATRON_NPU_DIR}/pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
        "--seq-length 128 --max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 1 "
        "--train-iters 5 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 128\n"
    )
    rep = cli.migrate_text(text, "bash", npu_dir=NPU_DIR)
    assert rep.result.changes == [] and rep.result.text == text
    assert rep.verdict == "ok", rep.to_json()


def test_bad_input(tmp_path, capsys):
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/bash\nif then fi (\n")
    assert cli.main([str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not valid bash" in err[0]
    assert cli.main([str(tmp_path / "missing.sh")]) == 2


def test_other_launchers_and_insert_point():
    text = (
        "#!/bin/bash\n"
        "export CUDA_DEVICE_MAX_CONNECTIONS=1\n"
        "ARGS=(--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128\n"
        "      --max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 8 --train-iters 5\n"
        "      --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 128\n"
        "      --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2)\n"
        "srun --ntasks-per-node=8 python /megatron/pretrain_gpt.py ${ARGS[@]}\n"
        "export AFTER=1\n"
    )
    rep = cli.migrate_text(text, "bash", npu_dir=NPU_DIR)
    out = rep.result.text.split("\n")
    # the added settings land before the launch, not after the later export
    assert out.index("MEGATRON_NPU_DIR=${MEGATRON_NPU_DIR:-/opt/megatron-npu}") < out.index(
        "srun --ntasks-per-node=8 python ${MEGATRON_NPU_DIR}/pretrain_gpt.py ${ARGS[@]}"
    )
    assert out[2] == "# megatron-npu migrate: Ascend settings (override from the environment)"
    assert rep.layout["world_size"] is None and "TP only" in rep.checks["layout"]
    assert rep.verdict == "ok", rep.to_json()
    rep = cli.migrate_text(text.replace("--tensor-model-parallel-size 4", "--tensor-model-parallel-size 3"), "bash")
    assert rep.verdict == "refused" and "TP=3" in rep.checks["layout"]


def test_python_module_entry(tmp_path):
    """python -m megatron_npu.migrate runs the same main (what the cli.py SUBCOMMANDS line points at)."""
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "megatron_npu.migrate", "--list-rules"],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "MEGATRON_NPU_AUTOPATCH": "0"},
        timeout=600,
    )
    assert proc.returncode == 0 and "visible-devices" in proc.stdout


def test_env_statements():
    text = (
        "#!/bin/bash\n"
        "export NCCL_NVLS_ENABLE=0 FOO=1\n"
        "export NCCL_P2P_LEVEL=NVL NVTE_X=1\n"
        "export NCCL_ALGO\n"
        "unset NCCL_ALGO\n"
        "export GLOO_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME\n"
        "export NCCL_BUFFSIZE=$BUF\n"
        "A=(\n"
        "  --tp-comm-overlap # fast\n"
        ")\n"
    )
    rep = cli.migrate_text(text, "bash")
    out = rep.result.text.split("\n")
    assert out[1] == "export FOO=1"  # only the NCCL assignment goes; FOO stays exported
    assert out[2].startswith("# export NCCL_P2P_LEVEL=NVL NVTE_X=1  # megatron-npu migrate: NCCL setting")
    assert out[3].startswith("# export NCCL_ALGO  # ")
    assert out[4] == "unset NCCL_ALGO"
    assert out[5] == "export GLOO_SOCKET_IFNAME=$HCCL_SOCKET_IFNAME"
    assert out[6] == "export HCCL_BUFFSIZE=$BUF"  # not a literal: renamed, unit conversion left to the user
    assert any("MB" in f.reason for f in rep.result.unsupported)
    assert "  # fast" in out and "--tp-comm-overlap" not in rep.result.text
    assert cli.bash_syntax(rep.result.text) is None
    assert cli.migrate_text(rep.result.text, "bash").result.changes == []


def test_heredoc_body_untouched():
    text = (
        "#!/bin/bash\n"
        "cat > notes.txt <<'EOF'\n"
        "don't touch: --tp-comm-overlap NCCL_DEBUG=INFO\n"
        "EOF\n"
        "python pretrain_gpt.py --tp-comm-overlap  # it's removed here\n"
    )
    rep = cli.migrate_text(text, "bash", npu_dir=NPU_DIR)
    out = rep.result.text.split("\n")
    assert "don't touch: --tp-comm-overlap NCCL_DEBUG=INFO" in out
    assert "python ${MEGATRON_NPU_DIR}/pretrain_gpt.py  # it's removed here" in out
    assert {c["rule"] for c in rep.to_json()["changes"]} >= {"tp-comm-overlap", "entry"}


def test_migrate_follows_the_trainers_policy():
    """One table (megatron_npu/policy.py): a value the trainer accepts stays, one it refuses goes,
    and every rule's reason is the trainer's."""
    from megatron_npu.policy import refusal_for
    from megatron_npu.training.arguments import known_flags

    text = (
        "#!/bin/bash\n"
        "python pretrain_gpt.py --cuda-graph-impl none --num-layers 2\n"
        "python pretrain_gpt.py --cuda-graph-impl local --num-layers 2\n"
    )
    out = cli.migrate_text(text, "bash", npu_dir=NPU_DIR).result.text.split("\n")
    assert out[-3:] == [
        "python ${MEGATRON_NPU_DIR}/pretrain_gpt.py --cuda-graph-impl none --num-layers 2",
        "python ${MEGATRON_NPU_DIR}/pretrain_gpt.py --num-layers 2",
        "",
    ]
    assert "--cuda-graph-impl" in known_flags()  # the trainer parses it to check the value
    yaml_text = "cuda_graph_impl: none\nenable_cuda_graph: true\n"
    assert cli.migrate_text(yaml_text, "yaml").result.text == "cuda_graph_impl: none\nenable_cuda_graph: false\n"
    for rule in RULES:
        row = refusal_for(rule.match) if rule.kind == "flag" else None
        if row is not None:
            assert rule.reason.startswith(row.reason), rule
    # fp8 knobs migrate refuses are refused by the trainer with the same words
    assert refusal_for("--num-layers-at-start-in-bf16").reason == refusal_for("--fp8-format").reason


def test_keep_entry_point_runs_the_users_own_pretrain_gpt_through_the_launcher():
    script = (
        "#!/bin/bash\n"
        "torchrun --nproc_per_node 8 /opt/Megatron-LM/pretrain_gpt.py --tensor-model-parallel-size 2 "
        "--transformer-impl transformer_engine --distributed-backend nccl\n"
        "python tools/pretrain_gpt.py --num-layers 2\n"
    )
    report = cli.migrate_text(script, "bash", keep_entry_point=True)
    lines = report.result.text.splitlines()
    assert "torchrun --nproc_per_node 8 -m megatron_npu.run /opt/Megatron-LM/pretrain_gpt.py" in report.result.text
    assert any(line.startswith("python -m megatron_npu.run tools/pretrain_gpt.py") for line in lines)
    assert "MEGATRON_NPU_DIR" not in report.result.text  # this project's trainer is not used
    assert "--transformer-impl local" in report.result.text  # device rules still apply
    # this trainer's rows do not: upstream's parser accepts only nccl/gloo, and the patch layer maps nccl
    assert "--distributed-backend nccl" in report.result.text
    assert "--distributed-backend hccl" in cli.migrate_text(script, "bash").result.text
    assert [c.rule for c in report.result.changes].count("keep-entry") == 2
    # Migrating the migrated script again changes no entry point.
    again = cli.migrate_text(report.result.text, "bash", keep_entry_point=True)
    assert "keep-entry" not in [c.rule for c in again.result.changes]
    assert again.result.text.count("-m megatron_npu.run") == 2


def effective_hccl_timeouts(tmp_path: Path, script: str, environ: dict[str, str]) -> dict[str, str]:
    """Run a migrated script with a stand-in torchrun that records what it was given; then apply what
    the npu accelerator adds at init_process_group (from --distributed-timeout-minutes, where unset)."""
    from datetime import timedelta

    from megatron_npu.accelerator.npu import NpuAccelerator

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    fake = bin_dir / "torchrun"
    fake.write_text('#!/bin/bash\nenv | grep "^HCCL_" > "$RECORD.env"\nprintf "%s\\n" "$@" > "$RECORD.args"\n')
    fake.chmod(0o755)
    path = tmp_path / "run.sh"
    path.write_text(script)
    record = tmp_path / "record"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RECORD": str(record), **environ}
    subprocess.run(["bash", str(path)], env=env, check=True, timeout=600)
    seen = dict(line.split("=", 1) for line in Path(f"{record}.env").read_text().splitlines())
    minutes = float(cli.flag_values(Path(f"{record}.args").read_text().splitlines())["--distributed-timeout-minutes"])
    npu = object.__new__(NpuAccelerator)  # the mapping reads no device state (torch_npu needs CANN)
    return {**seen, **npu.collective_timeout_environment(timedelta(minutes=minutes), seen)}


def test_migrated_script_leaves_hccl_timeouts_to_the_flag(tmp_path):
    """--distributed-timeout-minutes sets HCCL's link set-up and execution timeouts unless the user
    exported them: a migrated script must not export a default that silently wins over the flag."""
    script = (
        "#!/bin/bash\n"
        "export CUDA_DEVICE_MAX_CONNECTIONS=1\n"
        "torchrun --nproc_per_node 2 pretrain_gpt.py --distributed-timeout-minutes 60 --num-layers 2\n"
    )
    rep = cli.migrate_text(script, "bash", npu_dir=NPU_DIR)
    assert rep.verdict != "refused", rep.to_json()
    flag_wins = effective_hccl_timeouts(tmp_path / "a", rep.result.text, {})
    assert flag_wins == {"HCCL_CONNECT_TIMEOUT": "3600", "HCCL_EXEC_TIMEOUT": "3600"}
    user_wins = effective_hccl_timeouts(tmp_path / "b", rep.result.text, {"HCCL_CONNECT_TIMEOUT": "1800"})
    assert user_wins == {"HCCL_CONNECT_TIMEOUT": "1800", "HCCL_EXEC_TIMEOUT": "3600"}
    assert "HCCL_CONNECT_TIMEOUT" not in rep.result.text


def test_virtual_stages_come_from_the_trainers_layout_rules():
    """The virtual-pipeline size is ParallelDims.from_args' (the trainer's), for either flag."""
    launch = "torchrun --nproc_per_node 4 pretrain_gpt.py --num-layers 8 --pipeline-model-parallel-size 2 {}\n"
    rep = cli.migrate_text(launch.format("--num-layers-per-virtual-pipeline-stage 2"), "bash", npu_dir=NPU_DIR)
    assert rep.checks["layout"] == "ok" and (rep.layout["vpp"], rep.layout["dp"]) == (2, 2)
    rep = cli.migrate_text(launch.format("--num-virtual-stages-per-pipeline-rank 4"), "bash", npu_dir=NPU_DIR)
    assert rep.checks["layout"] == "ok" and rep.layout["vpp"] == 4
    # 4 layers per stage do not split into chunks of 3: the trainer refuses it, so migrate does
    rep = cli.migrate_text(launch.format("--num-layers-per-virtual-pipeline-stage 3"), "bash", npu_dir=NPU_DIR)
    assert rep.verdict == "refused"
    assert "not divisible by --num-layers-per-virtual-pipeline-stage 3" in rep.checks["layout"]
    rep = cli.migrate_text(launch.format("--num-virtual-stages-per-pipeline-rank 3"), "bash", npu_dir=NPU_DIR)
    assert "not divisible by --num-virtual-stages-per-pipeline-rank 3" in rep.checks["layout"]


def test_context_parallel_and_fsdp_scripts_migrate_without_a_refusal():
    """Megatron-LM's CP flags (ring, Ulysses, hierarchical, per-layer lists) and FSDP flags (Megatron-FSDP,
    torch FSDP2) are the trainer's own: copied, parsed, no refusal; a TP x CP block wider than a node is a note."""
    launch = (
        "torchrun --nproc_per_node 8 --nnodes 2 pretrain_gpt.py --num-layers 4 --hidden-size 256 "
        "--num-attention-heads 16 --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 "
        "--global-batch-size 16 --train-iters 10 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 1024 --bf16 {}\n"
    )
    cp = "--context-parallel-size {} --attention-dropout 0 "
    cases = {
        "ring": cp.format(2) + "--cp-comm-type p2p",
        "ulysses": cp.format(2) + "--cp-comm-type a2a",
        "hierarchical": cp.format(4) + "--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2",
        "per-layer": cp.format(2) + "--cp-comm-type p2p a2a p2p a2a",
        "megatron-fsdp": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
        "--use-distributed-optimizer --ckpt-format fsdp_dtensor",
        "torch-fsdp2": "--use-torch-fsdp2 --untie-embeddings-and-output-weights",
    }
    for name, flags in cases.items():
        rep = cli.migrate_text(launch.format(flags), "bash", npu_dir=NPU_DIR)
        assert rep.verdict == "ok" and rep.checks["flags"].startswith("ok"), (name, rep.checks)
        assert not rep.errors and not rep.result.unsupported, name
        assert flags.split()[0] in find_launch(rep.result.text).args, name
    rep = cli.migrate_text(launch.format(cp.format(4) + "--tensor-model-parallel-size 4"), "bash", npu_dir=NPU_DIR)
    assert rep.verdict == "ok" and rep.layout["cp"] == 4
    (note,) = [n for n in rep.result.notes if n.item == "context parallel layout"]
    assert note.reason.startswith("TP 4 x CP 4 = 16 ranks do not fit in a node of 8")


# ---- NVIDIA's own example style, MindSpeed-LLM's flags, value ranges, the exit status ------------------


def nvidia_llama3_script() -> str:
    """examples/llama/train_llama3_8b_h100_fp8.sh of Megatron-LM core_v0.16.1, as NVIDIA ships it."""
    import tarfile

    from megatron_lm_checkout import TARBALL

    if not TARBALL.exists():
        pytest.skip(f"{TARBALL} is not here")
    with tarfile.open(TARBALL) as tar:
        member = tar.extractfile("examples/llama/train_llama3_8b_h100_fp8.sh")
        assert member is not None
        return member.read().decode()


def test_nvidias_llama3_fp8_example_reads_quoted_array_elements_and_its_own_branches(tmp_path, capsys):
    """Array elements such as "--data-path $DATA_ARG" are a flag and its value; only the branch bash takes on
    the script's own defaults (mock data, fp8) counts; --force leaves no empty "" element; fused attention."""
    text = nvidia_llama3_script()
    src = tmp_path / "train_llama3_8b_h100_fp8.sh"
    src.write_text(text)
    assert cli.main([str(src), "-o", str(tmp_path / "refused.sh")]) == 1  # fp8, named, nothing written
    assert "fp8 is not supported" in capsys.readouterr().err and not (tmp_path / "refused.sh").exists()
    rc, _, report, out = run(tmp_path, "", "--force", src=src)
    migrated = out.read_text()
    assert rc == 0 and report["starts"] and report["checks"]["flags"].startswith("ok"), report["checks"]
    assert not [f for f in report["unsupported"] if "does not accept" in f["reason"]], report["unsupported"]
    assert '""' not in migrated and "--fp8" not in migrated
    assert_only_reported_lines_change(text, migrated, report)
    bash_n(out)
    launch = find_launch(migrated)
    assert launch.args[launch.args.index("--tokenizer-type") + 1] == "NullTokenizer"  # one word each
    assert "--mock-data" in launch.args and "--data-path" not in launch.args  # the MOCK defaults' branch
    assert "--use-flash-attn" in launch.args and "--attention-backend" not in launch.args
    (backend,) = [c for c in report["changes"] if c["rule"] == "attention-backend"]
    assert backend["before"].strip() == "--attention-backend fused" and backend["after"].strip() == "--use-flash-attn"
    # real data: the else branch, its quoted "--data-path $DATA_ARG" read as the flag and the value
    real = text.replace('DATA_ARG=${4:-"MOCK"}', "DATA_ARG=/data/llama3_text_document").replace(
        'TOKENIZER_ARG=${3:-"MOCK"}', "TOKENIZER_ARG=/models/llama3"
    )
    report = cli.migrate_text(real, "bash", force=True, npu_dir=NPU_DIR)
    args = find_launch(report.result.text).args
    assert args[args.index("--data-path") + 1] == "/data/llama3_text_document" and "--mock-data" not in args
    assert args[args.index("--tokenizer-type") + 1] == "HuggingFaceTokenizer"
    assert report.checks["flags"].startswith("ok") and report.starts


def test_if_conditions_the_expander_evaluates():
    from megatron_npu.migrate.bash_parse import condition_value

    env = {"A": "MOCK", "B": "", "C": "x"}
    assert condition_value('[[ "$A" == "MOCK" ]]', env) is True
    assert condition_value('[[ "$A" == "MOCK" ]] && [[ -n "$B" ]]', env) is False
    assert condition_value('[[ "$C" == "MOCK" ]] || [[ -z "$B" ]]', env) is True
    assert condition_value('[ "$A" != "MOCK" ]', env) is False
    assert condition_value('! [[ "$A" == "MOCK" ]]', env) is False
    assert condition_value('[ ! -f "$A" ]', env) is None  # a file test: not evaluated
    assert condition_value('[[ "$UNSET" == "x" ]]', env) is None
    script = (
        'MODE=${MODE:-b}\nif [[ "$MODE" == "a" ]]; then\n  X=(--num-layers 2)\nelif [[ "$MODE" == "b" ]]; then\n'
        "  X=(--num-layers 4)\nelse\n  X=(--num-layers 8)\nfi\npython pretrain_gpt.py ${X[@]}\n"
    )
    assert find_launch(script).args == ["--num-layers", "4"]
    unknown = "if [ -f /etc/x ]; then\n  X=(--num-layers 2)\nfi\npython pretrain_gpt.py ${X[@]}\n"
    assert find_launch(unknown).args == ["--num-layers", "2"]  # a test it cannot evaluate: the then branch


def test_mindspeed_llm_fused_op_flags_are_dropped_with_the_reason(tmp_path):
    """MindSpeed-LLM's _add_fusion_op_args switches: the fused kernel follows the model's own flags here."""
    from megatron_npu.policy import ConfigError
    from megatron_npu.training.arguments import parse_args

    mindspeed = [
        "--use-fused-rmsnorm",
        "--use-fused-swiglu",
        "--use-fused-rotary-pos-emb",
        "--use-fused-ring-attention-update",
        "--use-mc2",
        "--use-fused-mlp",
    ]
    model = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
        "--micro-batch-size 1 --global-batch-size 8 --train-iters 10 --lr 1e-4 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 1024 --normalization RMSNorm --swiglu --use-flash-attn"
    )
    script = "ARGS=(\n" + "".join(f"    {flag}\n" for flag in mindspeed) + ")\n"
    script += f"torchrun --nproc_per_node 8 pretrain_gpt.py {model} ${{ARGS[@]}}\n"
    src = tmp_path / "mindspeed.sh"
    src.write_text(script)
    rc, _, report, out = run(tmp_path, "", src=src)
    assert rc == 0 and report["starts"] and report["verdict"] == "ok", report
    dropped = {c["before"].strip(): c["reason"] for c in report["changes"] if c["rule"].startswith("ms-")}
    assert sorted(dropped) == sorted(mindspeed)
    assert all(reason.startswith("it is MindSpeed-LLM's switch; ") for reason in dropped.values())
    assert "npu_rms_norm" in dropped["--use-fused-rmsnorm"] and "npu_swiglu" in dropped["--use-fused-swiglu"]
    assert not any(flag in out.read_text() for flag in mindspeed)
    with pytest.raises(ConfigError, match="--use-fused-rmsnorm is not supported: it is MindSpeed-LLM's switch"):
        parse_args([*model.split(), "--use-fused-rmsnorm"], world_size=1, check_paths=False)


def test_environment_values_are_brought_into_the_counterparts_range():
    text = (
        "export NCCL_IB_TIMEOUT=22\nexport NCCL_IB_TC=106\nexport NCCL_IB_SL=3\n"
        "export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-23}\nexport NCCL_IB_TIMEOUT=19\n"
    )
    report = cli.migrate_text(text, "bash", npu_dir=NPU_DIR)
    assert report.result.text.split("\n")[:5] == [
        "export HCCL_RDMA_TIMEOUT=20",
        "export HCCL_RDMA_TC=104",
        "export HCCL_RDMA_SL=3",
        "export HCCL_RDMA_TIMEOUT=${HCCL_RDMA_TIMEOUT:-20}",
        "export HCCL_RDMA_TIMEOUT=19",
    ]
    reasons = [c.reason for c in report.result.changes]
    assert "22 -> 20: HCCL_RDMA_TIMEOUT takes 5-20 on Atlas A2/A3" in reasons[0]
    assert "106 -> 104: HCCL_RDMA_TC takes 0-255, a multiple of 4" in reasons[1]
    assert "->" not in reasons[2] and "->" not in reasons[4]


def test_the_exit_status_says_whether_the_migrated_script_would_start(tmp_path, capsys):
    src = tmp_path / "bad.sh"
    src.write_text("torchrun --nproc_per_node 1 pretrain_gpt.py --num-layers 2 --bogus-flag 3\n")
    rc, _, report, out = run(tmp_path, "", src=src)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and not report["starts"] and out.exists()  # written, so the user can fix it
    assert err == [
        "megatron-npu migrate: error: the migrated script would not start: pretrain_gpt.py does not accept --bogus-flag"
    ]
    assert cli.main([str(tmp_path / "missing.sh")]) == 2
    assert capsys.readouterr().err.startswith("megatron-npu migrate: error: cannot read ")
