"""Prometheus text parsing and histogram quantiles for the cluster benchmark."""

from __future__ import annotations

import pytest

from scheduler_plugins.devtools.bench.promtext import (
    Histogram,
    MetricsFormatError,
    counter_totals,
    find,
    histograms,
    parse,
)

TEXT = """\
# HELP rpc_seconds Time per RPC
# TYPE rpc_seconds histogram
rpc_seconds_bucket{method="PreFilter",code="OK",le="0.001"} 2
rpc_seconds_bucket{method="PreFilter",code="OK",le="0.01"} 6
rpc_seconds_bucket{method="PreFilter",code="OK",le="0.1"} 10
rpc_seconds_bucket{method="PreFilter",code="OK",le="+Inf"} 10
rpc_seconds_count{method="PreFilter",code="OK"} 10
rpc_seconds_sum{method="PreFilter",code="OK"} 0.25
rpc_seconds_bucket{code="OK",method="PreBind",le="0.001"} 0
rpc_seconds_bucket{code="OK",method="PreBind",le="0.01"} 0
rpc_seconds_bucket{code="OK",method="PreBind",le="0.1"} 1
rpc_seconds_bucket{code="OK",method="PreBind",le="+Inf"} 4
rpc_seconds_count{code="OK",method="PreBind"} 4
rpc_seconds_sum{code="OK",method="PreBind"} 9.0
process_resident_memory_bytes 1.5e+08
weird{msg="a \\"quoted\\" \\\\ value, with comma"} 1 1700000000000
"""


def test_parse_samples_and_labels() -> None:
    samples = parse(TEXT)
    assert len(samples) == 14
    weird = samples[-1]
    assert weird.labels == (("msg", 'a "quoted" \\ value, with comma'),)
    assert samples[-2].value == pytest.approx(1.5e8)


def test_histograms_group_series_by_labels_without_le() -> None:
    hs = histograms(parse(TEXT))
    assert [(h.name, h.label("method")) for h in hs] == [
        ("rpc_seconds", "PreBind"),
        ("rpc_seconds", "PreFilter"),
    ]
    pf = find(hs, "rpc_seconds", (("code", "OK"), ("method", "PreFilter")))
    assert pf is not None
    assert (pf.count, pf.total, pf.mean()) == (10, 0.25, 0.025)


@pytest.mark.parametrize(
    ("q", "want"),
    [
        (0.1, 0.0005),  # rank 1 of the 2 in (0, 0.001]
        (0.2, 0.001),
        (0.5, 0.001 + 0.009 * 3 / 4),  # rank 5: 3rd of 4 in (0.001, 0.01]
        (1.0, 0.1),
    ],
)
def test_quantile_interpolates_like_histogram_quantile(q: float, want: float) -> None:
    pf = next(h for h in histograms(parse(TEXT)) if h.label("method") == "PreFilter")
    assert pf.quantile(q) == pytest.approx(want)


def test_quantile_in_the_inf_bucket_is_the_highest_finite_bound() -> None:
    pb = next(h for h in histograms(parse(TEXT)) if h.label("method") == "PreBind")
    assert pb.quantile(0.99) == pytest.approx(0.1)


def test_empty_histogram_has_no_quantile() -> None:
    h = Histogram("x", (), ((1.0, 0.0), (float("inf"), 0.0)), 0.0, 0.0)
    assert h.quantile(0.5) is None and h.mean() is None
    with pytest.raises(MetricsFormatError):
        h.quantile(1.5)


def test_minus_keeps_only_new_observations() -> None:
    before = Histogram("x", (), ((0.01, 1.0), (0.1, 2.0), (float("inf"), 2.0)), 2.0, 0.05)
    after = Histogram("x", (), ((0.01, 1.0), (0.1, 5.0), (float("inf"), 6.0)), 6.0, 2.05)
    d = after.minus(before)
    assert d.buckets == ((0.01, 0.0), (0.1, 3.0), (float("inf"), 4.0))
    assert (d.count, d.total) == (4.0, pytest.approx(2.0))
    assert d.quantile(0.5) == pytest.approx(0.01 + 0.09 * 2 / 3)
    assert after.minus(None) is after


@pytest.mark.parametrize(
    "line", ["rpc_seconds_bucket{le=0.1} 3", "no value here", 'x{a="b"} notanumber']
)
def test_parse_rejects_malformed_lines(line: str) -> None:
    with pytest.raises(MetricsFormatError, match="metrics line 1"):
        parse(line)


def test_counter_totals_sum_over_the_labels_left_out() -> None:
    text = """\
apiserver_request_total{code="201",resource="pods",subresource="",verb="POST"} 10
apiserver_request_total{code="409",resource="pods",subresource="",verb="POST"} 2
apiserver_request_total{code="201",resource="pods",subresource="binding",verb="POST"} 9
apiserver_request_total{code="200",resource="pods",verb="PATCH"} 4
other_total{verb="POST"} 100
"""
    totals = counter_totals(
        parse(text), "apiserver_request_total", ("verb", "resource", "subresource")
    )
    assert totals == {
        (("verb", "POST"), ("resource", "pods"), ("subresource", "")): 12.0,
        (("verb", "POST"), ("resource", "pods"), ("subresource", "binding")): 9.0,
        (("verb", "PATCH"), ("resource", "pods"), ("subresource", "")): 4.0,
    }
