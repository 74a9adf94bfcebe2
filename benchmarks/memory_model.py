"""This project's memory model and Megatron-LM's ``report_theoretical_memory`` against measured bytes.

    python benchmarks/memory_model.py [LAYOUT ...]   # default: every layout of the test

One torchrun job of 4 ranks (tests/fixtures/layout/memory_check_worker.py: the trainer's builders,
a real step on the cpu target, measured as --memory-report measures) runs the layouts of
tests/layout/test_memory_model.py. For each layout it prints, per rank, the relative error against
the measured bytes of

* ours: megatron_npu/layout/memory.py for that rank (parameters + gradients + optimizer state; the
  saved-for-backward bytes at the schedule's peak);
* Megatron-LM core_v0.16.1's megatron/training/theoretical_memory_usage.py, loaded unmodified from
  ../shared/megatron-lm/megatron-lm-core_v0.16.1-training.tar.gz: its weight-and-optimizer figure
  (the most loaded shard) and its activation figure (the first stage), the same for every rank.

Run on demand; never a timed test.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tarfile
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARBALL = ROOT.parent / "shared" / "megatron-lm" / "megatron-lm-core_v0.16.1-training.tar.gz"
MEMBER = "megatron/training/theoretical_memory_usage.py"
MB = 1024 * 1024  # Megatron-LM's unit


def load_megatron_lm(tmp: Path) -> types.ModuleType:
    """theoretical_memory_usage.py from the tarball, its one import (``.utils.print_rank_0``) served
    by a stand-in package so that megatron/training (CUDA, triton) is not imported."""
    with tarfile.open(TARBALL) as archive:
        [member] = [m for m in archive.getmembers() if m.name.endswith(MEMBER)]
        archive.extract(member, tmp, filter="data")
    package = types.ModuleType("_mlm_training")
    package.__path__ = []  # type: ignore[attr-defined]
    utils = types.ModuleType("_mlm_training.utils")
    utils.print_rank_0 = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    sys.modules.update({"_mlm_training": package, "_mlm_training.utils": utils})
    spec = importlib.util.spec_from_file_location("_mlm_training.theoretical_memory_usage", tmp / member.name)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


class _Args(argparse.Namespace):
    """Megatron-LM's args: a flag this trainer lacks (multi-latent attention, MTP, ...) reads as unset."""

    def __getattr__(self, name: str) -> None:
        return None


def megatron_lm_figures(module: types.ModuleType, args: dict) -> tuple[float, float]:
    """(weights + optimizer, activations) bytes by Megatron-LM's formulas for this run's settings."""
    ns = _Args(**args)
    ns.is_hybrid_model, ns.mtp_num_layers = False, None
    ns.data_parallel_size = args["world_size"] // (
        args["tensor_model_parallel_size"] * args["pipeline_model_parallel_size"] * args["context_parallel_size"]
    )
    microbatches = args["global_batch_size"] // (args["micro_batch_size"] * ns.data_parallel_size)
    weights, activations, _ = module.report_theoretical_memory(ns, num_microbatches=microbatches)
    return weights * MB, activations * MB


def run_worker(layouts: list[str]) -> list[dict]:
    from distributed import torchrun

    job = torchrun(ROOT / "tests" / "fixtures" / "layout" / "memory_check_worker.py", *layouts, nproc=4, timeout=1800)
    if job.returncode:
        raise SystemExit(job.stderr[-3000:])
    return job.results()


def main(argv: list[str] | None = None) -> int:
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "layout")]
    from test_memory_model import EXACT_LAYOUTS, UPPER_BOUND_LAYOUTS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("layouts", nargs="*", default=[*EXACT_LAYOUTS, *UPPER_BOUND_LAYOUTS])
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        module = load_megatron_lm(Path(tmp))
    results = run_worker(a.layouts)
    print("relative error against the measured bytes, per rank (ours / Megatron-LM report_theoretical_memory)")
    print(f"{'layout':22} {'rank':>4} {'state MB':>9} {'ours':>7} {'M-LM':>7}   {'act. MB':>8} {'ours':>7} {'M-LM':>7}")
    worst = {"ours_state": 0.0, "mlm_state": 0.0, "ours_act": 0.0, "mlm_act": 0.0}
    for r in sorted(results, key=lambda r: (r["layout"], r["rank"])):
        m, ours = r["measured"], r["predicted"]
        state = m["param_bytes"] + m["grad_bytes"] + m["optimizer_bytes"]
        act = m["saved_peak_bytes"]
        mlm_state, mlm_act = megatron_lm_figures(module, r["args"])
        errors = {
            "ours_state": ours["state_bytes"] / state - 1,
            "mlm_state": mlm_state / state - 1,
            "ours_act": ours["saved_peak_bytes"] / act - 1,
            "mlm_act": mlm_act / act - 1,
        }
        for k, v in errors.items():
            worst[k] = max(worst[k], abs(v))
        print(
            f"{r['layout']:22} {r['rank']:4d} {state / 1e6:9.3f} {errors['ours_state']:+7.1%} {errors['mlm_state']:+7.1%}"
            f"   {act / 1e6:8.3f} {errors['ours_act']:+7.1%} {errors['mlm_act']:+7.1%}"
        )
    print(
        f"worst |error|: state ours {worst['ours_state']:.1%}, Megatron-LM {worst['mlm_state']:.1%}; "
        f"activations ours {worst['ours_act']:.1%}, Megatron-LM {worst['mlm_act']:.1%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
