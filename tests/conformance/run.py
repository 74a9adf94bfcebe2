"""Run megatron-core's own unit tests on the patch layer and write the conformance table.

    python -m tests.conformance.run [FOLDER ...] [--nproc 8] [--timeout 300] [--out DIR] [--megatron-lm PATH]

Each FOLDER (relative to ``tests/unit_tests``, a file works too) runs as upstream runs it:
``torchrun --nproc_per_node 8 -m pytest -m "not flaky"`` from the suite's root (upstream's CPU-less "lts"
markers; experimental tests with ``--experimental``, as upstream's second pass), with ``-p conformance_plugin`` (the patch layer in every
rank, per-rank records, the per-test timeout). A job that dies on a hung or crashed test is
started again after that test, so one hang costs one test, not the folder. Exit status 0 when
every failure is an expected one and no expected failure passes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .environment import missing_line, missing_test_packages, missing_tools_line
from .results import (
    FolderReport,
    TestResult,
    collection_of,
    judge,
    merge,
    read_records,
    table,
    target_capabilities,
    unmet_needs,
)
from .suite import REPO, TAG, WORKDIR, CheckoutError, megatron_lm_files, missing_tools, unpack

PLUGIN_DIR = Path(__file__).resolve().parent
#: Upstream's CPU-less ("lts") environment deselects ``flaky`` only (tests/unit_tests/run_ci_test.sh); ``flaky_in_dev``
#: is its dev environment's, and ``experimental`` tests run in its second pass with ``--experimental`` (the plugin
#: sets that option for exactly those tests). Each deselected test is counted under its marker.
DESELECTED_MARKERS = ("flaky",)
MARKERS = " and ".join(f"not {marker}" for marker in DESELECTED_MARKERS)
#: Upstream's last bucket (tests/test_utils/recipes/h100/unit-tests.yaml: ``tests/unit_tests/**/*.py`` less the
#: folders other buckets run) is one session: the files directly in tests/unit_tests and the small folders, in
#: pytest's order. Its tests rely on that order (utils/test_experimental_log_once.py expects torch.distributed
#: initialized by a test before it, as there: alone, ranks 1-7 log nothing and fail), so they run as that bucket.
TOP_LEVEL = "top-level"
#: The bucket's subfolders this harness runs so far; the others are ignored until they join (see the docs).
TOP_LEVEL_FOLDERS = ("fusions", "utils")


#: Files run apart from their bucket, with fewer ranks than upstream's 8 (each rank runs every test; these are
#: single-process tests): path -> ranks, and why. test_optimizer_cpu_offloading.py steps BigNet (35M parameters)
#: with Adam, its host copies and fp32 masters, ~2.9 GB a rank: 8 ranks were killed by the OOM killer on 24 GiB.
APART = {"test_optimizer_cpu_offloading.py": 1}


DEFAULT_FOLDERS = (
    "tensor_parallel",
    "pipeline_parallel",
    "distributed",
    "optimizer",
    "dist_checkpointing",
    "transformer",
    "models",
    "data",
    "ssm/test_mamba_hybrid_layer_allocation.py",
    "rl/test_sequence_packing_utils.py",
    "inference",
    # the last bucket's other subfolders, each on its own (no test there relies on an earlier one's state)
    "export",
    "extension",
    "post_training",
    "resharding",
    "tokenizers",
    "a2a_overlap",
    TOP_LEVEL,
    *APART,
)
MAX_ATTEMPTS = 12


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _environment(out: Path, timeout: float, deselect: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("MEGATRON_NPU_DEVICE", "cpu")
    # Short: the async checkpoint writer's unix socket path lives here. One per run: the suite's checkpoint
    # directory is TMPDIR/pytest-of-USER/tmp_dist_ckpt, which each session's rank 0 removes at its end, so two
    # runs side by side removed each other's checkpoints (test_optimizer.py: "Checkpoint directory ... does
    # not exist").
    tmp = WORKDIR / "tmp" / str(os.getpid())
    tmp.mkdir(parents=True, exist_ok=True)
    env.update(
        CONFORMANCE_OUT=str(out),
        CONFORMANCE_TEST_TIMEOUT=str(timeout),
        CONFORMANCE_DESELECT=str(deselect),
        CONFORMANCE_DESELECTED_MARKERS=",".join(DESELECTED_MARKERS),
        TMPDIR=str(tmp),
        OMP_NUM_THREADS="1",
        # The ranks run from the suite's root: the patch layer under test is this checkout's (an editable install
        # may point at another copy, or at none).
        PYTHONPATH=os.pathsep.join(filter(None, [str(PLUGIN_DIR), str(REPO), env.get("PYTHONPATH", "")])),
    )
    return env


def _target(folder: str, root: Path) -> list[str]:
    if folder != TOP_LEVEL:
        return [f"tests/unit_tests/{folder}"]
    others = sorted(p.name for p in (root / "tests/unit_tests").iterdir() if p.is_dir() and p.name != "__pycache__")
    ignored = [f"--ignore=tests/unit_tests/{name}" for name in others if name not in TOP_LEVEL_FOLDERS]
    ignored += [f"--ignore=tests/unit_tests/{path}" for path in APART]
    return [*ignored, "tests/unit_tests"]


def _command(folder: str, nproc: int, root: Path, ignore: list[str] = ()) -> list[str]:
    nproc = min(nproc, APART.get(folder, nproc))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    torchrun += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    pytest = ["-m", "pytest", "-p", "conformance_plugin", "-p", "no:cacheprovider", "-q", "-m", MARKERS]
    # Upstream's addopts stop at the first failure (-x) and at a collection error: a table needs all.
    pytest += ["--maxfail", "1000000", "--continue-on-collection-errors"]
    pytest += [f"--ignore=tests/unit_tests/{path}" for path in ignore]
    return [*torchrun, *pytest, *_target(folder, root)]


def _launch(root: Path, folder: str, out: Path, args: argparse.Namespace, deselect: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "job.log", "w") as log:
        process = subprocess.Popen(
            _command(folder, args.nproc, root, args.ignore),
            cwd=root,
            env=_environment(out, args.timeout, deselect),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return process.wait(timeout=args.job_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait()
            return -1


def _unfinished(records: list[dict]) -> set[str]:
    """Tests some rank started and never finished (hung, or the job died under them)."""
    merged = merge(records)
    return {nodeid for nodeid, result in merged.items() if result.outcome in ("hang", "crash")}


def _job_failure(folder: str, log: Path) -> TestResult:
    """A job that ended before any test (a conftest import error, a launch failure): one named error."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith(("E ", "Error"))]
    return TestResult(folder, "error", message="job ended before any test: " + " / ".join(lines[:3]), detail=str(log))


def _earlier_attempts(directory: Path) -> tuple[list[dict], float, int]:
    """Records, seconds and count of the attempts an earlier (killed) run left in ``directory``; a test
    some rank was still running when that run was killed (a crash record) runs again."""
    attempts = sorted(directory.glob("attempt*"), key=lambda path: int(path.name.removeprefix("attempt")))
    records = [record for attempt in attempts for record in read_records(attempt)]
    killed = {nodeid for nodeid, result in merge(records).items() if result.outcome == "crash"}
    seconds = sum(float((a / "seconds.txt").read_text()) for a in attempts if (a / "seconds.txt").exists())
    return [record for record in records if record["nodeid"] not in killed], seconds, len(attempts)


def run_folder(root: Path, folder: str, args: argparse.Namespace) -> FolderReport:
    report = FolderReport(folder)
    slug = folder.replace("/", "__")
    records: list[dict] = []
    earlier_seconds, first = 0.0, 0
    if args.resume:
        records, earlier_seconds, first = _earlier_attempts(args.out / slug)
    done: set[str] = set(merge(records))
    start = time.monotonic()
    for attempt in range(first, first + MAX_ATTEMPTS):
        out = args.out / slug / f"attempt{attempt}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        deselect = out / "deselect.txt"
        deselect.write_text("\n".join(sorted(done)))
        attempt_start = time.monotonic()
        returncode = _launch(root, folder, out, args, deselect)
        (out / "seconds.txt").write_text(f"{time.monotonic() - attempt_start:.1f}")
        new = read_records(out)
        records.extend(new)
        report.attempts = attempt + 1
        if not new and returncode != 0:
            report.results[folder] = _job_failure(folder, out / "job.log")
        stuck = _unfinished(new)
        print(f"  {folder} attempt {attempt}: exit {returncode}, {len(merge(new))} tests, stuck: {sorted(stuck)}")
        if not stuck or stuck <= done:
            break
        done |= set(merge(new))
    report.seconds = earlier_seconds + time.monotonic() - start
    report.results.update(merge(records))
    report.collection = collection_of(records)
    print(f"  {report.accounting()} ({report.seconds:.0f} s)", flush=True)
    return report


def recorded_folder(folder: str, out: Path) -> FolderReport:
    """A folder's report from the records of an earlier run (its time is not kept)."""
    attempts = sorted((out / folder.replace("/", "__")).glob("attempt*"))
    report = FolderReport(folder, attempts=len(attempts))
    records = [record for attempt in attempts for record in read_records(attempt)]
    report.results = merge(records)
    report.collection = collection_of(records)
    return report


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.conformance.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", default=list(DEFAULT_FOLDERS), help="under tests/unit_tests")
    parser.add_argument("--nproc", type=int, default=8, help="ranks, as upstream (8)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one test may take (then: hang)")
    parser.add_argument("--job-timeout", type=float, default=4 * 3600.0, help="seconds one torchrun job may take")
    parser.add_argument("--ignore", action="append", default=[], help="a path under tests/unit_tests not to run")
    parser.add_argument("--resume", action="store_true", help="keep the attempts already in --out, run the rest")
    parser.add_argument("--rejudge", action="store_true", help="judge the records already in --out, run nothing")
    parser.add_argument("--out", type=Path, default=WORKDIR / "results", help="records, logs, table.md")
    parser.add_argument(
        "--megatron-lm",
        type=Path,
        default=os.environ.get("CONFORMANCE_MEGATRON_LM") or None,
        help=f"a Megatron-LM {TAG} work tree or git directory: the files the shared extracts lack come from it "
        "(default: $CONFORMANCE_MEGATRON_LM)",
    )
    return parser.parse_args(argv)


def _added_files(args: argparse.Namespace) -> dict[str, bytes]:
    """Megatron-LM's files the extracts lack, from --megatron-lm; without it their tests fail, named at the start."""
    missing = missing_tools()
    if not args.megatron_lm:
        if line := missing_tools_line(missing, TAG):
            print(line, flush=True)
        return {}
    added, where = megatron_lm_files(args.megatron_lm, missing)
    print(f"conformance: added {', '.join(added) or 'nothing'} {where}", flush=True)
    return added


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    os.environ.setdefault("MEGATRON_NPU_DEVICE", "cpu")  # the harness target unless told otherwise
    if not args.rejudge and (line := missing_line(missing_test_packages())):
        print(line, flush=True)
    try:
        added = {} if args.rejudge else _added_files(args)
    except CheckoutError as error:
        print(f"conformance: --megatron-lm: {error}", file=sys.stderr)
        return 2
    reports = []
    for folder in args.folders:
        if args.rejudge:
            reports.append(recorded_folder(folder, args.out))
            continue
        print(f"running {folder} ...", flush=True)
        reports.append(run_folder(unpack(added=added), folder, args))
    # Needs are checked on the machine judging: where one is met (a package installed, /opt/data provided) its
    # environment limits no longer apply and a failure is unexpected.
    verdict = judge(reports, target_capabilities(), unmet_needs(megatron_lm=bool(args.megatron_lm)))
    text = table(reports, verdict)
    text += f"\nWhole run: {sum(r.seconds for r in reports):.0f} s over {len(reports)} folders\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text)
    (args.out / "results.json").write_text(
        json.dumps({r.folder: {k: vars(v) for k, v in r.results.items()} for r in reports}, indent=1)
    )
    print(text)
    return 0 if verdict.clean else 1


if __name__ == "__main__":
    sys.exit(main())
