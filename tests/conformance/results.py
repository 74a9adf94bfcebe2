"""Per-rank records merged into one outcome per test, failures given a cause, the table written."""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .expected import CAUSES, EXPECTED_FAILURES, TARGET_LIMITS, ExpectedFailure

# Worst first: a test's outcome is the worst any rank reported.
SEVERITY = ("hang", "crash", "failed", "error", "xpassed", "passed", "xfailed", "skipped")
FAILING = {"hang", "crash", "failed", "error"}
# A skip whose reason is the missing CUDA device: the test did not run on this target.
DEVICE_SKIP = re.compile(r"\bcuda\b|\bgpus?\b", re.IGNORECASE)
# Suggested causes for a failure not in the expected list (a hint for whoever triages it).
HINTS = (
    ("te", re.compile(r"transformer_engine|Transformer ?Engine|\bTE[A-Z]\w+|\bTE\b|te_checkpoint", re.I)),
    (
        "cuda_only",
        re.compile(r"cuda ?graph|cudagraph|nvshmem|cudnn|symmetric|fp8|float8|cuda_graph|nvgrouped|grouped_gemm", re.I),
    ),
)


@dataclass
class TestResult:
    nodeid: str
    outcome: str
    message: str = ""
    detail: str = ""
    duration: float = 0.0

    @property
    def folder_file(self) -> str:
        return self.nodeid.split("::", 1)[0]


@dataclass
class FolderReport:
    folder: str
    results: dict[str, TestResult] = field(default_factory=dict)
    seconds: float = 0.0
    attempts: int = 0

    def count(self, *outcomes: str) -> int:
        return sum(1 for result in self.results.values() if result.outcome in outcomes)

    def device_skips(self) -> int:
        return sum(1 for r in self.results.values() if r.outcome == "skipped" and DEVICE_SKIP.search(r.message))


def _rank_outcome(events: dict[str, dict]) -> tuple[str, dict]:
    """One rank's outcome of one test from its setup/call/teardown (or hang) records."""
    if "hang" in events:
        return "hang", events["hang"]
    if "collect_error" in events:
        return "error", events["collect_error"]
    setup, call, teardown = events.get("setup"), events.get("call"), events.get("teardown")
    if setup is None or (teardown is None and not (setup.get("outcome") == "skipped")):
        if setup is not None and setup.get("outcome") == "failed":
            return "error", setup
        return "crash", events.get("start", {"message": "the rank died during this test"})
    if setup["outcome"] == "failed":
        return "error", setup
    if setup["outcome"] == "skipped":
        return ("xfailed" if setup.get("xfail") else "skipped"), setup
    if call is not None and call["outcome"] == "failed":
        return "failed", call
    if call is not None and call["outcome"] == "skipped":
        return ("xfailed" if call.get("xfail") else "skipped"), call
    if teardown is not None and teardown["outcome"] == "failed":
        return "error", teardown
    return ("xpassed" if call is not None and call.get("xpass") else "passed"), call or setup


def read_records(directory: Path) -> list[dict]:
    records = []
    for path in sorted(directory.glob("rank*.jsonl")):
        records.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return records


def merge(records: Iterable[dict]) -> dict[str, TestResult]:
    """One result per test: the worst outcome over the ranks, with that rank's message."""
    by_test: dict[str, dict[int, dict[str, dict]]] = {}
    for record in records:
        by_test.setdefault(record["nodeid"], {}).setdefault(record["rank"], {})[record["event"]] = record
    merged = {}
    for nodeid, ranks in by_test.items():
        outcomes = [_rank_outcome(events) for events in ranks.values()]
        outcome, record = min(outcomes, key=lambda item: SEVERITY.index(item[0]))
        duration = max(float(events.get("call", {}).get("duration", 0.0)) for events in ranks.values())
        merged[nodeid] = TestResult(nodeid, outcome, record.get("message", ""), record.get("detail", ""), duration)
    return merged


def target_capabilities() -> set[str]:
    """The TARGET_LIMITS capabilities the accelerator under test has (MEGATRON_NPU_DEVICE)."""
    from megatron_npu.accelerator import get_accelerator

    accelerator = get_accelerator()
    return {
        entry.capability for entry in TARGET_LIMITS if entry.capability and accelerator.capability(entry.capability)
    }


def expected_entry(
    nodeid: str, entries: Iterable[ExpectedFailure] = EXPECTED_FAILURES, capabilities: set[str] = frozenset()
) -> ExpectedFailure | None:
    for entry in [*entries, *(e for e in TARGET_LIMITS if e.capability in capabilities)]:
        if fnmatch.fnmatchcase(nodeid, entry.pattern):
            return entry
    return None


def hint(result: TestResult) -> str:
    for text in (result.message, result.detail):  # the message names the cause better than the traceback
        for cause, pattern in HINTS:
            if pattern.search(text):
                return cause
    return "unclassified"


@dataclass
class Verdict:
    expected: list[tuple[TestResult, ExpectedFailure]] = field(default_factory=list)
    unexpected: list[TestResult] = field(default_factory=list)
    now_passing: list[tuple[TestResult, ExpectedFailure]] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.unexpected and not self.now_passing


def judge(reports: Iterable[FolderReport], capabilities: set[str] = frozenset()) -> Verdict:
    verdict = Verdict()
    for report in reports:
        for result in report.results.values():
            entry = expected_entry(result.nodeid, capabilities=capabilities)
            if result.outcome in FAILING:
                if entry is not None and result.outcome in ("failed", "error"):
                    verdict.expected.append((result, entry))
                else:
                    verdict.unexpected.append(result)
            elif entry is not None and result.outcome == "passed":
                verdict.now_passing.append((result, entry))
    return verdict


def _cell(text: str, limit: int = 160) -> str:
    line = " ".join(text.split())
    return (line[: limit - 1] + "…" if len(line) > limit else line).replace("|", "\\|")


def table(reports: list[FolderReport], verdict: Verdict) -> str:
    lines = [
        "| folder | passed | failed | errors | hangs/crashes | skipped | of which not run (CUDA) "
        "| expected failures | time (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    expected_ids = {result.nodeid for result, _ in verdict.expected}
    for report in reports:
        expected = sum(1 for nodeid in report.results if nodeid in expected_ids)
        lines.append(
            f"| {report.folder} | {report.count('passed', 'xpassed')} | {report.count('failed')} "
            f"| {report.count('error')} | {report.count('hang', 'crash')} | {report.count('skipped', 'xfailed')} "
            f"| {report.device_skips()} | {expected} | {report.seconds:.0f} |"
        )
    lines += ["", f"Unexpected failures ({len(verdict.unexpected)}): cause suggested by the message", ""]
    lines += ["| test | outcome | suggested cause | message |", "|---|---|---|---|"]
    for result in verdict.unexpected:
        cause = CAUSES[hint(result)] if hint(result) in CAUSES else hint(result)
        lines.append(f"| {result.nodeid} | {result.outcome} | {cause} | {_cell(result.message)} |")
    lines += ["", f"Expected failures ({len(verdict.expected)})", ""]
    lines += ["| test | cause | reason | message |", "|---|---|---|---|"]
    for result, entry in verdict.expected:
        cause = CAUSES[entry.cause] + (f" (target: {entry.capability})" if entry.capability else "")
        lines.append(f"| {result.nodeid} | {cause} | {entry.reason} | {_cell(result.message, 100)} |")
    if verdict.now_passing:
        lines += ["", "Listed as expected failures but passing now (remove them from expected.py):", ""]
        lines += [f"- {result.nodeid} ({entry.pattern})" for result, entry in verdict.now_passing]
    return "\n".join(lines) + "\n"
