"""The testbed's pure parts, without namespaces (tests/integration/test_hosts_faults.py
builds real ones where it can)."""

from __future__ import annotations

import pytest
from flightq_bench import hosts


@pytest.mark.parametrize(
    ("text", "bps"),
    [("10gbit", 10**10), ("25gbit", 25 * 10**9), ("1gbit", 10**9), ("500mbit", 5 * 10**8),
     ("2.5Gbit", 25 * 10**8)],
)  # fmt: skip
def test_a_link_rate_reads_as_tc_writes_it(text: str, bps: int) -> None:
    assert hosts.parse_rate(text) == bps


@pytest.mark.parametrize("text", ["10G", "fast", "10 gbps", ""])
def test_a_link_rate_without_a_unit_is_refused_naming_the_forms(text: str) -> None:
    with pytest.raises(ValueError, match=r"expected a number and a unit, e\.g\. 10gbit"):
        hosts.parse_rate(text)


def test_a_testbed_of_no_hosts_is_refused_before_anything_is_built() -> None:
    with pytest.raises(ValueError, match="hosts: expected 1 to 200, got 0"):
        hosts.Testbed(0)
