"""What the release matrix (test_release_matrix.py, the full check) and its quick check (test_release_quick.py)
share: which releases each runs, a launch in a release's venv, the doctor with the tag's Megatron-LM checkout,
and the comparisons of RESULT lines."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from distributed import ROOT, Job, base_env, free_port, run  # noqa: E402
from envs import RELEASES, Release, interpreter  # noqa: E402
from megatron_lm_checkout import unpack  # noqa: E402
from pretrain_runs import MODEL as PROJECT_MODEL  # noqa: E402
from pretrain_runs import NO_DROPOUT  # noqa: E402

SELECT_ENVVAR = "MEGATRON_NPU_RELEASES"
CI_DEFAULT = ("0.12.1", "0.19.2")
SHARED = ROOT.parent / "shared" / "megatron-lm"
STEPS, SAVE_AT = 4, 2
MISSING_TARGET = "megatron-npu: error: patch"  # the registry's line for a target missing in a claimed release
DECOUPLED = "optimizer.get_standard_config_overrides.is_decoupled_lr"  # a patch target that exists only from 0.16
COMPARE = ROOT / "tests" / "releases" / "compare_checkpoints.py"
LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+)")


def full_matrix_releases() -> list[str]:
    """The releases the full matrix runs: ``MEGATRON_NPU_RELEASES`` (comma-separated, or ``all``), else CI's two:
    the oldest and the newest."""
    wanted = os.environ.get(SELECT_ENVVAR, "")
    if wanted == "all":
        return list(RELEASES)
    if wanted:
        return [name.strip() for name in wanted.split(",") if name.strip()]
    return list(CI_DEFAULT)


def unavailable(release: Release) -> str | None:
    """Why ``release`` cannot be verified on this machine (one line), or None. A missing venv is no reason: it is
    built on first use (envs.py; on a fresh machine 3.11 venvs take 12-30 s each, the Python 3.12 CUDA torch the
    0.17-0.19 venvs share 84 s, each 3.12 venv 6-94 s more), so a fresh machine verifies every release."""
    if interpreter(release.python) is None:
        return f"megatron-core {release.core}: no python{release.python} on this machine"
    return None


def torchrun(python: Path, script: Path | str, *args: str, nproc: int, env: dict, module: bool = False) -> Job:
    command = [str(python), "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1"]
    command += ["--master_addr=127.0.0.1", f"--master_port={free_port()}", *(["--module"] if module else [])]
    return run([*command, str(script), *args], env=env, timeout=900).check()


def tag_checkout(release: Release, where: Path) -> tuple[Path, dict]:
    """That tag's Megatron-LM training stack unpacked under ``where``, and an environment with it on the path."""
    checkout = unpack(SHARED / release.tarball_name, where / "megatron-lm")
    env = base_env()
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), env["PYTHONPATH"]])
    return checkout, env


def doctor(python: Path, env: dict) -> Job:
    return run([str(python), "-m", "megatron_npu", "doctor", "--json"], env=env, timeout=300)


def assert_doctor_clean(release: Release, job: Job) -> None:
    """Every patch claiming the release found its target (megatron/training's included), none left pending."""
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-2000:]
    report = json.loads(job.stdout)
    assert report["versions"]["megatron_core"] == report["patches_for_release"] == release.core
    assert report["errors"] == [] and report["megatron_lm"]["tested"] is True
    states = {row["name"]: row["state"] for row in report["patches"]}
    assert "missing" not in states.values() and "pending" not in states.values(), states  # every target looked up
    assert all(
        states[name] == "applied" for name in report["megatron_lm"]["patches"] if states[name] != "other-release"
    )
    assert states[DECOUPLED] == ("other-release" if release.minor < 16 else "applied")


def record_figures(where: Path, release: Release, seconds: dict, errors: Callable[[], dict]) -> None:
    """The figures the README's table quotes: the seconds of each part and ``errors()`` (the worst relative loss
    differences, whether the resumes were exact), printed on one line and written beside the runs (figures.json).
    A run without losses records why instead: the tests say which run it was."""
    figures: dict = {"release": release.core, "seconds": {k: round(v, 1) for k, v in seconds.items()}}
    try:
        figures.update(errors())
    except (KeyError, ValueError, ZeroDivisionError) as missing:
        figures["unavailable"] = repr(missing)
    (where / "figures.json").write_text(json.dumps(figures))
    print(f"FIGURES {json.dumps(figures)}")


def last_stage(results: dict, key: str = "losses") -> list[float]:
    """The losses every last-stage rank reported (they agree); other ranks report none."""
    [found] = {json.dumps(r[key]) for r in results.values() if r[key]}
    return json.loads(found)


def worst(actual: list[float], expected: list[float]) -> float:
    return max(abs(a - e) / abs(e) for a, e in zip(actual, expected, strict=True))


def assert_close(actual: list[float], expected: list[float], rel: float = 1e-5) -> None:
    assert len(actual) == len(expected) == STEPS
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert abs(a - e) <= rel * abs(e), f"step {step}: {a} vs {e}"


def megatron_lm_flags(release: Release) -> list[str]:
    vocab = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(release.vocab_size)]
    flags = [*PROJECT_MODEL, "--eval-interval", "1000", *NO_DROPOUT, *vocab, "--train-iters", "6"]
    flags += ["--use-distributed-optimizer", "--save-interval", "3"]
    if release.minor >= 15:  # the fully reshardable optimizer layout (the flag is new in core_v0.15)
        flags.append("--dist-ckpt-optim-fully-reshardable")
    return flags


def megatron_lm_train_and_resume(release: Release, python: Path, checkout: Path, env: dict, where: Path) -> dict:
    """That tag's pretrain_gpt.py through ``-m megatron_npu.run`` on one rank: 6 iterations saving at 3 and 6, a
    resume from 3 to 6, and every tensor of the two iteration-6 checkpoints compared (2 launches, one process)."""
    script, flags = str(checkout / "pretrain_gpt.py"), megatron_lm_flags(release)
    save, resumed_save = where / "ckpt", where / "resumed"
    where.mkdir(parents=True, exist_ok=True)
    full = torchrun(python, "megatron_npu.run", script, *flags, "--save", str(save), nproc=1, env=env, module=True)
    resumed_save.mkdir()
    (resumed_save / "iter_0000003").symlink_to(save / "iter_0000003", target_is_directory=True)
    (resumed_save / "latest_checkpointed_iteration.txt").write_text("3")
    flags += ["--load", str(resumed_save), "--save", str(resumed_save)]
    resumed = torchrun(python, "megatron_npu.run", script, *flags, nproc=1, env=env, module=True)
    checkpoints = [str(folder / "iter_0000006") for folder in (save, resumed_save)]
    compared = run([str(python), str(COMPARE), *checkpoints, str(where)], env=env, timeout=300).check()
    return {"full": full, "resumed": resumed, "compared": compared.by_rank()[0]}


def losses(job: Job) -> dict[int, float]:
    """Megatron-LM's iteration lines' ``lm loss`` by iteration."""
    return {int(m.group(1)): float(m.group(2)) for m in map(LOSS_LINE.search, job.stdout.splitlines()) if m}


def megatron_lm_resumed_exactly(runs: dict) -> bool:
    full, resumed = losses(runs["full"]), losses(runs["resumed"])
    return all(resumed.get(i) == full.get(i) for i in (4, 6))


def assert_megatron_lm_trains_and_resumes_bit_exactly(runs: dict) -> None:
    full, resumed = losses(runs["full"]), losses(runs["resumed"])
    assert sorted(full) == [1, 2, 3, 4, 5, 6] and sorted(resumed) == [4, 5, 6]
    assert full[6] < full[1]
    # Megatron-LM's second log line of a process averages two iterations (its accumulator): compare 4 and 6
    assert resumed[4] == full[4] and resumed[6] == full[6]
    # every tensor of the iteration-6 checkpoints (model, optimizer state), compared in the release's venv
    compared = runs["compared"]
    assert compared["same_keys"] and compared["keys"] > 16 and compared["unequal"] == []
