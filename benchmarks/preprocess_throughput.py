"""Preprocessing throughput and peak memory, 1 vs 2 workers, two corpus sizes, in one run.

    python benchmarks/preprocess_throughput.py [--repeat 20] [--unique] [--megatron-lm /path/to/Megatron-LM]

The bundled corpus (data/demo_corpus.jsonl) is repeated --repeat times (small size) and
4x that (large size) into temp files so the runs are long enough to time. A repeated corpus
flatters the word cache (megatron_npu/data/word_cache.py: after the first copy every word is
a hit), so --unique adds a corpus with no repetition: every .py file of this Python's
standard library as one document (~30 MB; built at run time, not shipped). Each run is a
fresh process (so peak RSS belongs to that run alone): the in-process figures exclude the
megatron-core import; "wall" includes it, which is how Megatron-LM's own script is timed
(with --megatron-lm; it is not installed, so otherwise it is reported as not measured).
Peak memory is measured two ways: the largest single process's RSS (os.wait4's
ru_maxrss, which covers the pool workers) and, with psutil, the process tree's summed PSS
(forked workers share the parent's pages; PSS counts each shared page once) sampled every
20 ms. Ratios are measured within this one run; never used as a timed test.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOKENIZER = "GPTSentencePieceTokenizer"


def _child(argv: list[str]) -> int:
    """Runs in the measured process: import first, then time run() alone."""
    import resource

    import megatron.core.datasets.indexed_dataset  # noqa: F401  (import cost kept out of the timing)

    from megatron_npu.data import preprocess
    from megatron_npu.data.preprocess import parse_args, run

    base_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = run(parse_args(argv))
    cache = getattr(preprocess._TOK, "_encode_batch", None)  # in-process (workers=1) only
    hits = cache.hits / max(1, cache.hits + cache.misses) if cache is not None and cache.exact else None
    print(
        "RESULT "
        + json.dumps(
            dict(
                docs=r["docs"],
                tokens=r["tokens"],
                seconds=r["seconds"],
                problems=sum(len(v) for v in r["problems"].values()),
                base_rss_mb=base_kb / 1024,
                hit_rate=hits,
            )
        ),
        flush=True,
    )
    return 0


def _measure(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run cmd, sampling the tree's summed PSS; return wall time, peaks and its stdout."""
    try:
        import psutil
    except ImportError:
        psutil = None
    out = tempfile.TemporaryFile(mode="w+")
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, text=True)
    tree_peak = 0
    if psutil is not None:
        root = psutil.Process(p.pid)
        while True:
            try:
                if root.status() == psutil.STATUS_ZOMBIE:
                    break
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            total = 0
            for q in procs:
                try:
                    total += q.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            tree_peak = max(tree_peak, total)
            time.sleep(0.02)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    out.seek(0)
    text = out.read()
    return dict(
        rc=p.returncode,
        wall=wall,
        max_proc_mb=ru.ru_maxrss / 1024,
        cpu=ru.ru_utime + ru.ru_stime,
        tree_mb=tree_peak / 2**20 if psutil is not None else None,
        out=text,
    )


def _corpus(src: Path, repeat: int, path: Path) -> None:
    data = src.read_bytes()
    if not data.endswith(b"\n"):
        data += b"\n"
    with open(path, "wb") as f:
        for _ in range(repeat):
            f.write(data)


def _unique_corpus(path: Path) -> None:
    """One document per standard-library .py file: ~30 MB in which no document repeats."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    with open(path, "w", encoding="utf-8") as f:
        for src in sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts):
            text = src.read_text(encoding="utf-8", errors="replace").strip()
            if text:
                f.write(json.dumps({"text": text}) + "\n")


def _spin(n: int) -> float:
    t = time.perf_counter()
    x = 0
    for i in range(n):
        x += i * i
    return time.perf_counter() - t


def _parallel_ceiling() -> float:
    """What 2 processes can gain over 1 on this host: pure-Python work, 1 alone vs 2 at once.

    Virtual CPUs are often shares of fewer physical ones; no preprocessor scales past this.
    """
    import multiprocessing as mp

    n = 5_000_000
    alone = min(_spin(n) for _ in range(2))
    with mp.get_context("fork").Pool(2) as pool:
        t0 = time.perf_counter()
        pool.map(_spin, [n, n])
        both = time.perf_counter() - t0
    return 2 * alone / both


def _mlm_in_run_seconds(out: str) -> float | None:
    """Megatron-LM's own figure: its last 'Processed N documents (D docs/s' line, as N / D."""
    import re

    found = re.findall(r"Processed (\d+) documents \(([\d.e+]+) docs/s", out)
    return int(found[-1][0]) / float(found[-1][1]) if found else None


def _fmt_mb(x: float | None) -> str:
    return "n/a" if x is None else f"{x:8.1f}"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return _child(sys.argv[2:])
    from megatron_npu.data import DEMO_CORPUS, DEMO_TOKENIZER_MODEL

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=20, help="copies of the demo corpus in the small size")
    ap.add_argument("--large-factor", type=int, default=4, help="large size = repeat * this")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--unique", action="store_true", help="add a corpus with no repeated documents")
    ap.add_argument("--megatron-lm", metavar="PATH", help="a Megatron-LM checkout to time tools/preprocess_data.py")
    ap.add_argument("--keep", metavar="DIR", help="write corpora and outputs here instead of a temp dir")
    a = ap.parse_args()
    if a.repeat < 1 or a.large_factor < 1:
        ap.error("--repeat and --large-factor must be >= 1")
    mlm_script = None
    if a.megatron_lm:
        mlm_script = Path(a.megatron_lm) / "tools" / "preprocess_data.py"
        if not mlm_script.exists():
            ap.error(f"--megatron-lm {a.megatron_lm}: no tools/preprocess_data.py there")

    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    tmp_ctx = tempfile.TemporaryDirectory(prefix="preprocess_bench_") if not a.keep else None
    work = Path(a.keep or tmp_ctx.name)  # type: ignore[union-attr]
    work.mkdir(parents=True, exist_ok=True)
    sizes = {"small": a.repeat, "large": a.repeat * a.large_factor}
    if a.unique:
        sizes["unique"] = 1
    ceiling = _parallel_ceiling()
    print(
        f"corpus: {DEMO_CORPUS} x{sizes['small']} and x{sizes['large']}"
        f"{'; unique: the stdlib .py files' if a.unique else ''}; tokenizer {TOKENIZER} "
        f"(data/demo_spm.model); cpus visible: {os.cpu_count()}; "
        f"affinity: {len(os.sched_getaffinity(0))}; load average {os.getloadavg()[0]:.1f}"
    )
    print(f"this host's 2-vs-1 process ceiling (pure-Python work): {ceiling:.2f}x")
    rows: list[dict[str, Any]] = []
    for size, rep in sizes.items():
        inp = work / f"corpus_{size}.jsonl"
        if size == "unique":
            _unique_corpus(inp)
        else:
            _corpus(Path(DEMO_CORPUS), rep, inp)
        lines = sum(1 for _ in open(inp, "rb"))
        mb = inp.stat().st_size / 1e6
        for w in a.workers:
            prefix = work / f"ours_{size}_w{w}"
            args = [
                "--input",
                str(inp),
                "--output-prefix",
                str(prefix),
                "--append-eod",
                "--tokenizer-type",
                TOKENIZER,
                "--tokenizer-model",
                DEMO_TOKENIZER_MODEL,
                "--workers",
                str(w),
                "--log-interval",
                str(10**12),
            ]
            m = _measure([sys.executable, __file__, "--child", *args], env)
            line = [ln for ln in m["out"].splitlines() if ln.startswith("RESULT ")]
            if m["rc"] != 0 or not line:
                print(f"run failed (rc {m['rc']}):\n{m['out'][-3000:]}", file=sys.stderr)
                return 1
            r = json.loads(line[0][len("RESULT ") :])
            rows.append(dict(tool="ours", size=size, rep=rep, w=w, mb=mb, **r, **m, prefix=prefix))
            if mlm_script is not None:
                mp = work / f"mlm_{size}_w{w}"
                cmd = [
                    sys.executable,
                    str(mlm_script),
                    "--input",
                    str(inp),
                    "--output-prefix",
                    str(mp),
                    "--append-eod",
                    "--tokenizer-type",
                    TOKENIZER,
                    "--tokenizer-model",
                    DEMO_TOKENIZER_MODEL,
                    "--workers",
                    str(w),
                    "--log-interval",
                    str(lines),
                ]
                menv = dict(env, PYTHONPATH=os.pathsep.join([str(Path(a.megatron_lm)), env["PYTHONPATH"]]))
                mm = _measure(cmd, menv)
                if mm["rc"] != 0:
                    print(f"Megatron-LM run failed (rc {mm['rc']}):\n{mm['out'][-3000:]}", file=sys.stderr)
                    return 1
                same = all(
                    (Path(f"{mp}_text_document{e}").read_bytes() == Path(f"{prefix}_text_document{e}").read_bytes())
                    for e in (".bin", ".idx")
                )
                rows.append(
                    dict(
                        tool="megatron-lm",
                        size=size,
                        rep=rep,
                        w=w,
                        mb=mb,
                        docs=r["docs"],
                        tokens=r["tokens"],
                        seconds=_mlm_in_run_seconds(mm["out"]),
                        problems=0,
                        base_rss_mb=None,
                        hit_rate=None,
                        identical=same,
                        **mm,
                    )
                )

    print()
    print(
        f"{'tool':<12}{'size':<7}{'copies':>7}{'workers':>8}{'docs':>9}{'tokens':>11}{'MB':>8}"
        f"{'s(run)':>8}{'tok/s':>12}{'docs/s':>10}{'MB/s':>8}{'s(wall)':>9}{'tok/s wall':>12}"
        f"{'peakRSS proc MB':>16}{'tree PSS MB':>12}{'CPU s':>7}{'word hits':>10}"
    )
    for r in rows:
        s = r["seconds"]
        run_cols = (
            f"{s:8.2f}{r['tokens'] / s:12.0f}{r['docs'] / s:10.0f}{r['mb'] / s:8.2f}"
            if s
            else f"{'-':>8}{'-':>12}{'-':>10}{'-':>8}"
        )
        print(
            f"{r['tool']:<12}{r['size']:<7}{r['rep']:>7}{r['w']:>8}{r['docs']:>9}{r['tokens']:>11}"
            f"{r['mb']:8.1f}{run_cols}{r['wall']:9.2f}{r['tokens'] / r['wall']:12.0f}"
            f"{r['max_proc_mb']:16.1f}{_fmt_mb(r['tree_mb']):>12}{r['cpu']:7.1f}"
            f"{'-' if r['hit_rate'] is None else format(r['hit_rate'], '.1%'):>10}"
        )
    print()
    ours = {(r["size"], r["w"]): r for r in rows if r["tool"] == "ours"}
    if 1 in a.workers and 2 in a.workers:
        for size in sizes:
            one, two = ours[(size, 1)], ours[(size, 2)]
            print(
                f"{size}: 2-vs-1 workers tokens/s ratio {one['seconds'] / two['seconds']:.2f} (in-run), "
                f"{one['wall'] / two['wall']:.2f} (wall incl. import); host ceiling {ceiling:.2f}"
            )
    same12 = all(
        (
            Path(f"{ours[(s, a.workers[0])]['prefix']}_text_document{e}").read_bytes()
            == Path(f"{ours[(s, w)]['prefix']}_text_document{e}").read_bytes()
        )
        for s in sizes
        for w in a.workers
        for e in (".bin", ".idx")
    )
    print(f"outputs byte-identical across worker counts: {same12}")
    for w in a.workers:
        sm, lg = ours[("small", w)], ours[("large", w)]
        tree = "" if sm["tree_mb"] is None else f", tree PSS {sm['tree_mb']:.0f} -> {lg['tree_mb']:.0f} MB"
        print(
            f"peak memory, workers={w}: corpus {sm['mb']:.1f} -> {lg['mb']:.1f} MB "
            f"({a.large_factor}x): largest process {sm['max_proc_mb']:.0f} -> {lg['max_proc_mb']:.0f} MB"
            f"{tree} (after-import baseline {sm['base_rss_mb']:.0f} MB)"
        )
    if mlm_script is None:
        print(
            "Megatron-LM tools/preprocess_data.py: NOT MEASURED (not installed; pass --megatron-lm PATH "
            "to a checkout to time it side by side)"
        )
    else:
        for size in sizes:
            for w in a.workers:
                m = next(r for r in rows if r["tool"] == "megatron-lm" and r["size"] == size and r["w"] == w)
                o = ours[(size, w)]
                in_run = f"{m['seconds'] / o['seconds']:.2f} in-run (each tool's own clock), " if m["seconds"] else ""
                print(
                    f"vs Megatron-LM, {size}, workers={w}: tokens/s ours/theirs {in_run}"
                    f"{m['wall'] / o['wall']:.2f} wall; outputs identical: {m['identical']}"
                )
    load, ncpu = os.getloadavg()[0], len(os.sched_getaffinity(0))
    print(
        f"load average at the end {load:.1f} on {ncpu} CPUs"
        + (
            ": the host is shared and busy, so the tokens/s and 2-vs-1 ratios are understated;"
            " CPU s (whole process incl. import) is the contention-free cost"
            if load > ncpu * 0.75
            else ""
        )
    )
    if tmp_ctx is not None:
        tmp_ctx.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
