"""`flowlock bench --scale`'s sizes, slopes and JSON, without a server."""

from __future__ import annotations

import pytest

from flowlock.bench.report.scale_table import scale_json
from flowlock.bench.scale_load import instance_id, is_open, long_length, sizes_of
from flowlock.bench.scale_results import DEFAULT_SIZES, QUICK_SIZES, ScaleReport, parse_sizes
from flowlock.core.errors import InvalidInput


@pytest.mark.parametrize(
    ("text", "sizes"),
    [
        ("default", DEFAULT_SIZES),
        ("1e4,1e5,1e6", (10_000, 100_000, 1_000_000)),
        ("10^4, 10^5", (10_000, 100_000)),
        ("1000,5_000", (1_000, 5_000)),
        ("2e3", (2_000,)),
    ],
)
def test_sizes_are_read_as_written(text: str, sizes: tuple[int, ...]) -> None:
    assert parse_sizes(text) == sizes


def test_default_is_small_with_quick() -> None:
    assert parse_sizes("default", quick=True) == QUICK_SIZES


@pytest.mark.parametrize("text", ["", "ten", "1e4,1e3", "1e4,1e4", "50", "1e8", "1e99", "-5"])
def test_bad_sizes_are_refused_with_an_example(text: str) -> None:
    with pytest.raises(InvalidInput, match="--scale"):
        parse_sizes(text)


def test_the_loaded_shape() -> None:
    """Ids sort as their numbers, 90 % are open, and 10^6 instances carry 10^7 history rows."""
    assert sorted([instance_id(10), instance_id(9), instance_id(100)]) == [
        instance_id(9),
        instance_id(10),
        instance_id(100),
    ]
    assert sum(is_open(n) for n in range(1, 1001)) == 900
    assert long_length(1_000_000) == 100_000
    assert 10_000_000 <= sizes_of(1_000_000) <= 10_200_000


def _report(figures: tuple[dict[str, float], ...]) -> ScaleReport:
    return ScaleReport(
        sizes=(10_000, 1_000_000),
        history_rows=(100_000, 10_100_000),
        figures=figures,
        load_s=(1.0, 90.0),
        flowlock_version="0",
        postgres_version="15",
        cores=2,
        database="external",
        seed=1,
        quick=False,
        duration_s=100.0,
    )


def test_slopes_say_how_much_costlier_the_largest_size_is() -> None:
    """Latency: largest over smallest. Throughput: smallest over largest (slower is > 1)."""
    report = _report(
        (
            {"fire p99": 4.0, "spread applied/s": 1000.0, "count done": 1.0},
            {"fire p99": 5.0, "spread applied/s": 500.0, "count done": 0.0},
        )
    )
    assert report.slope("fire p99") == pytest.approx(1.25)
    assert report.slope("spread applied/s") == pytest.approx(2.0)
    assert report.slope("missing") is None
    doc = scale_json(report)
    assert doc["sizes"] == [10_000, 1_000_000]
    fire = doc["metrics"]["fire p99"]
    assert (fire["unit"], fire["values"], fire["aim_slope"]) == ("ms", [4.0, 5.0], 1.5)
    assert fire["slope"] == pytest.approx(1.25)
    aims = {a["metric"]: a["met"] for a in doc["aims"]}
    assert aims == {"fire p99": True, "spread applied/s": False}
