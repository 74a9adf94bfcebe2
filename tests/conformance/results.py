"""Per-rank records merged into one outcome per test, failures given a cause, the table written."""

from __future__ import annotations

import fnmatch
import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .expected import CAUSES, ENVIRONMENT_LIMITS, EXPECTED_FAILURES, TARGET_LIMITS, ExpectedFailure, Need

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
    #: The failure's exception type (``AssertionError``) and its message's first line: what an expected entry matches.
    exception: str = ""
    first_line: str = ""
    #: A collection error's file: the tests it hides (its ``def test_`` functions; None when not knowable).
    hidden: int | None = None

    @property
    def folder_file(self) -> str:
        return self.nodeid.split("::", 1)[0]


@dataclass
class Collection:
    """What a folder's sessions collected: every test id, the ones ``-m`` deselected (id -> marker), and the
    modules skipped at import (file -> pytest's reason)."""

    collected: list[str] = field(default_factory=list)
    deselected: dict[str, str] = field(default_factory=dict)
    module_skips: dict[str, str] = field(default_factory=dict)


def collection_of(records: Iterable[dict]) -> Collection:
    """The first session's collection (later attempts collect the same tests) and every module-level skip."""
    collection = Collection()
    for record in records:
        if record["event"] == "collection" and not collection.collected:
            collection.collected = list(record["collected"])
            collection.deselected = dict(record["deselected"])
        elif record["event"] == "module_skip":
            collection.module_skips[record["nodeid"]] = record["message"]
    return collection


# importorskip's reason: "could not import 'nvidia_resiliency_ext': No module named ..."
_NEEDED_PACKAGE = re.compile(r"could not import '([\w.]+)'")


def needed_package(reason: str) -> str:
    """The package a module-level skip waits for (its importorskip name), else the reason itself."""
    found = _NEEDED_PACKAGE.search(reason)
    return found.group(1) if found else reason


@dataclass
class FolderReport:
    folder: str
    results: dict[str, TestResult] = field(default_factory=dict)
    seconds: float = 0.0
    attempts: int = 0
    collection: Collection = field(default_factory=Collection)

    def count(self, *outcomes: str) -> int:
        return sum(1 for result in self.tests() if result.outcome in outcomes)

    def tests(self) -> list[TestResult]:
        """The results of collected tests (a file that failed to import is a collection error, not a test)."""
        return [result for result in self.results.values() if result.hidden is None and "::" in result.nodeid]

    def collection_errors(self) -> list[TestResult]:
        return [result for result in self.results.values() if result not in self.tests()]

    def device_skips(self) -> int:
        return sum(1 for r in self.tests() if r.outcome == "skipped" and DEVICE_SKIP.search(r.message))

    def skip_reasons(self) -> Counter[str]:
        return Counter(_skip_reason(r.message) for r in self.tests() if r.outcome == "skipped")

    def not_run(self) -> list[str]:
        """Collected, neither deselected nor recorded: left after the last restart (must be none)."""
        recorded = set(self.results) | set(self.collection.deselected)
        return [nodeid for nodeid in self.collection.collected if nodeid not in recorded]

    def accounting(self) -> str:
        """collected = passed + failed + errors + hangs + skipped (by reason) + xfailed + deselected (by marker) + not run,
        then what collection could not count: files that failed to import and modules skipped at import."""
        c = self.collection
        skipped = self.skip_reasons()
        markers = Counter(c.deselected.values())
        hidden = [r for r in self.collection_errors()]
        hidden_tests = sum(r.hidden or 0 for r in hidden)
        line = (
            f"{self.folder}: collected {len(c.collected)} = passed {self.count('passed', 'xpassed')}"
            f" + failed {self.count('failed')} + errors {self.count('error')} + hangs/crashes "
            f"{self.count('hang', 'crash')} + skipped {sum(skipped.values())}"
            + (f" ({'; '.join(f'{reason}: {n}' for reason, n in skipped.most_common())})" if skipped else "")
            + f" + xfailed {self.count('xfailed')} (as upstream marks them)"
            + f" + deselected {sum(markers.values())}"
            + (f" ({', '.join(f'{marker}: {n}' for marker, n in sorted(markers.items()))})" if markers else "")
            + f" + not run {len(self.not_run())}"
        )
        if hidden:
            line += (
                f"; {len(hidden)} files failed to import, hiding {hidden_tests} test functions (before parametrize): "
                + ", ".join(f"{r.nodeid.rsplit('/', 1)[-1]} ({_cell(_failure(r), 120)})" for r in hidden)
            )
        if c.module_skips:
            line += "; skipped at import: " + ", ".join(
                f"{path.rsplit('/', 1)[-1]} (needs {needed_package(reason)})" for path, reason in c.module_skips.items()
            )
        return line

    def balanced(self) -> bool:
        """Every collected test accounted for by exactly one term."""
        terms = len(self.tests()) + len(self.collection.deselected) + len(self.not_run())
        return terms == len(self.collection.collected)


def _skip_reason(message: str) -> str:
    """A skip's reason without pytest's prefix, on one line, short enough for the accounting line."""
    text = " ".join(message.split()).removeprefix("Skipped: ")
    return text if len(text) <= 90 else text[:89] + "…"


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


#: Records about a session, not a test (what was collected, a module skipped at import).
SESSION_EVENTS = ("collection", "module_skip")


def merge(records: Iterable[dict]) -> dict[str, TestResult]:
    """One result per test: the worst outcome over the ranks, with that rank's message."""
    by_test: dict[str, dict[int, dict[str, dict]]] = {}
    for record in records:
        if record["event"] in SESSION_EVENTS:
            continue
        by_test.setdefault(record["nodeid"], {}).setdefault(record["rank"], {})[record["event"]] = record
    merged = {}
    for nodeid, ranks in by_test.items():
        outcomes = [_rank_outcome(events) for events in ranks.values()]
        outcome, record = min(outcomes, key=lambda item: SEVERITY.index(item[0]))
        duration = max(float(events.get("call", {}).get("duration", 0.0)) for events in ranks.values())
        merged[nodeid] = TestResult(
            nodeid,
            outcome,
            record.get("message", ""),
            record.get("detail", ""),
            duration,
            record.get("exception", ""),
            record.get("first_line", ""),
            record.get("hidden"),
        )
    return merged


def target_capabilities() -> set[str]:
    """The TARGET_LIMITS capabilities the accelerator under test has (MEGATRON_NPU_DEVICE)."""
    from megatron_npu.accelerator import get_accelerator

    accelerator = get_accelerator()
    return {
        entry.capability for entry in TARGET_LIMITS if entry.capability and accelerator.capability(entry.capability)
    }


def unmet_needs(megatron_lm: bool = False) -> set[Need]:
    """The ENVIRONMENT_LIMITS needs this machine lacks (``megatron_lm``: Megatron-LM's tools were given)."""
    return {entry.needs for entry in ENVIRONMENT_LIMITS if entry.needs and not entry.needs.met(megatron_lm)}


def expected_entry(
    nodeid: str,
    entries: Iterable[ExpectedFailure] = EXPECTED_FAILURES,
    capabilities: set[str] = frozenset(),
    unmet: set[Need] = frozenset(),
) -> ExpectedFailure | None:
    limits = [
        *(e for e in TARGET_LIMITS if e.capability in capabilities),
        *(e for e in ENVIRONMENT_LIMITS if e.needs in unmet),
    ]
    for entry in [*entries, *limits]:
        if fnmatch.fnmatchcase(nodeid, entry.pattern):
            return entry
    return None


def hint(result: TestResult) -> str:
    failure = f"{result.exception}: {result.first_line}" if result.exception else ""
    # The exception names the cause better than the traceback (whose "test" read as a TE name to the pattern).
    for text in (failure,) if failure else (result.message, result.detail):
        for cause, pattern in HINTS:
            if pattern.search(text):
                return cause
    return "unclassified"


@dataclass
class Verdict:
    expected: list[tuple[TestResult, ExpectedFailure]] = field(default_factory=list)
    #: Failures of tests that need what this machine lacks (ENVIRONMENT_LIMITS), counted apart from the expected.
    environment: list[tuple[TestResult, ExpectedFailure]] = field(default_factory=list)
    unexpected: list[TestResult] = field(default_factory=list)
    now_passing: list[tuple[TestResult, ExpectedFailure]] = field(default_factory=list)
    #: Listed tests that failed another way than their entry states (counted among the unexpected too).
    failed_otherwise: list[tuple[TestResult, ExpectedFailure]] = field(default_factory=list)
    #: Collected tests without a result (left after the last restart), per folder.
    not_run: dict[str, list[str]] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        return not self.unexpected and not self.now_passing and not self.not_run


def judge(
    reports: Iterable[FolderReport], capabilities: set[str] = frozenset(), unmet: set[Need] = frozenset()
) -> Verdict:
    """``unmet``: the needs this machine lacks; an environment limit applies only to those (unmet_needs())."""
    verdict = Verdict()
    for report in reports:
        if missing := report.not_run():
            verdict.not_run[report.folder] = missing
        for result in report.results.values():
            entry = expected_entry(result.nodeid, capabilities=capabilities, unmet=unmet)
            if result.outcome in FAILING:
                if entry is not None and result.outcome in ("failed", "error") and entry.matches(result):
                    (verdict.environment if entry.needs else verdict.expected).append((result, entry))
                else:
                    verdict.unexpected.append(result)
                    if entry is not None:
                        verdict.failed_otherwise.append((result, entry))
            # A need is one way to pass, not the only one (the GPT-2 vocabulary downloads where there is network):
            # an environment limit passing without it is not stale.
            elif entry is not None and entry.needs is None and result.outcome == "passed":
                verdict.now_passing.append((result, entry))
    return verdict


def _cell(text: str, limit: int = 160) -> str:
    line = " ".join(text.split())
    return (line[: limit - 1] + "…" if len(line) > limit else line).replace("|", "\\|")


def table(reports: list[FolderReport], verdict: Verdict) -> str:
    lines = [
        "| folder | collected | passed | failed | errors | hangs/crashes | skipped | of which not run (CUDA) "
        "| deselected | not run | expected failures | environment limits | time (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    expected_ids = {result.nodeid for result, _ in verdict.expected}
    environment_ids = {result.nodeid for result, _ in verdict.environment}
    for report in reports:
        expected = sum(1 for nodeid in report.results if nodeid in expected_ids)
        environment = sum(1 for nodeid in report.results if nodeid in environment_ids)
        lines.append(
            f"| {report.folder} | {len(report.collection.collected)} | {report.count('passed', 'xpassed')} "
            f"| {report.count('failed')} | {report.count('error')} | {report.count('hang', 'crash')} "
            f"| {report.count('skipped', 'xfailed')} | {report.device_skips()} | {len(report.collection.deselected)} "
            f"| {len(report.not_run())} | {expected} | {environment} | {report.seconds:.0f} |"
        )
    lines += ["", "Accounting:", ""] + [f"- {report.accounting()}" for report in reports]
    lines += ["", environment_line(verdict)]
    for folder, missing in verdict.not_run.items():
        lines += ["", f"Not run in {folder} ({len(missing)}, no result after the last restart):", ""]
        lines += [f"- {nodeid}" for nodeid in missing]
    lines += ["", f"Unexpected failures ({len(verdict.unexpected)}): cause suggested by the message", ""]
    lines += ["| test | outcome | suggested cause | exception: first line |", "|---|---|---|---|"]
    otherwise = {result.nodeid: entry for result, entry in verdict.failed_otherwise}
    for result in verdict.unexpected:
        cause = CAUSES[hint(result)] if hint(result) in CAUSES else hint(result)
        if result.nodeid in otherwise:
            entry = otherwise[result.nodeid]
            cause = f"listed as {entry.exception}: /{entry.message}/, failed otherwise"
        lines.append(f"| {result.nodeid} | {result.outcome} | {cause} | {_cell(_failure(result))} |")
    lines += ["", f"Expected failures ({len(verdict.expected)})", ""]
    lines += ["| test | cause | reason | exception: first line |", "|---|---|---|---|"]
    for result, entry in verdict.expected:
        cause = CAUSES[entry.cause] + (f" (target: {entry.capability})" if entry.capability else "")
        lines.append(f"| {result.nodeid} | {cause} | {entry.reason} | {_cell(_failure(result), 100)} |")
    lines += ["", f"Environment limits ({len(verdict.environment)}): expected only where the need is unmet", ""]
    lines += ["| test | needs | reason | exception: first line |", "|---|---|---|---|"]
    for result, entry in verdict.environment:
        lines.append(f"| {result.nodeid} | {entry.needs} | {entry.reason} | {_cell(_failure(result), 100)} |")
    if verdict.now_passing:
        lines += ["", "Listed as expected failures but passing now (remove them from expected.py):", ""]
        lines += [f"- {result.nodeid} ({entry.pattern})" for result, entry in verdict.now_passing]
    return "\n".join(lines) + "\n"


def environment_line(verdict: Verdict) -> str:
    """environment limits: <n> (needs X: k, needs Y: m)"""
    needs = Counter(str(entry.needs) for _, entry in verdict.environment)
    counts = ", ".join(f"needs {need}: {n}" for need, n in needs.most_common())
    return f"environment limits: {len(verdict.environment)}" + (f" ({counts})" if counts else "")


def _failure(result: TestResult) -> str:
    return f"{result.exception}: {result.first_line}" if result.exception else result.message
