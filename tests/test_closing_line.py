"""The run's closing line (tests/conftest.py) names what the run did not verify, and why, in one line."""

from conftest import not_verified_line


def test_skips_sharing_a_cause_are_named_together_with_their_count():
    why = "the Python 3.12 CUDA torch is not cached"
    skips = {f"megatron-core 0.17.1: {why}": 4, f"megatron-core 0.18.2: {why}": 4, "Emerging-Optimizers is absent": 1}
    line = not_verified_line(skips, deselected=0)
    assert line == (
        f"not verified in this run: megatron-core 0.17.1, 0.18.2: {why} (8 tests); Emerging-Optimizers is absent (1 test)"
    )
    assert "\n" not in line


def test_deselected_tests_are_counted_and_a_complete_run_says_so():
    assert not_verified_line({}, deselected=249) == "not verified in this run: 249 tests deselected (-m / -k)"
    assert not_verified_line({}, deselected=0) == "not verified in this run: nothing (every collected test ran)"
