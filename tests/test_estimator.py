"""Properties of the performance model (estimator/model.py) and of unit parsing (estimator/units.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from estimator import (
    cache_efficiency,
    dataset_cache_efficiencies,
    dataset_cache_efficiency,
    hit_ratio,
    io_perf,
    remote_demand,
    silod_perf,
)
from estimator.errors import UserError
from estimator.units import UnitError, format_rate, format_size, parse_rate, parse_size

FAST = settings(max_examples=60, deadline=None)

# Realistic magnitudes: rates up to ~10 GB/s, sizes from 1 MB to 100 TB.
rates = st.floats(min_value=0.0, max_value=1e10, allow_nan=False)
pos_rates = st.floats(min_value=1e3, max_value=1e10, allow_nan=False)
sizes = st.floats(min_value=1e6, max_value=1e14, allow_nan=False)
fractions = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


# ---------------------------------------------------------------------------------------------
# Worked values from the paper (§4 and §7.1.1)


def test_paper_resnet_partially_cached_needs_52_6_mb_s():
    # ResNet-50 at 114 MB/s on 1.3 TB with 0.7 TB cached: 114 * (1 - 0.7/1.3) = 114 * 6/13 = 52.615 MB/s.
    assert remote_demand(114e6, 0.7e12, 1.3e12) == pytest.approx(114e6 * 6 / 13)
    assert remote_demand(114e6, 0.7e12, 1.3e12) == pytest.approx(52.6e6, rel=1e-3)
    # Cache efficiencies quoted in §7.1.1: 87 MB/s/TB, 53 MB/s/TB, 0.4 MB/s/TB.
    assert cache_efficiency(114e6, 1.3e12) * 1e12 == pytest.approx(87.7e6, rel=1e-3)
    assert cache_efficiency(69e6, 1.3e12) * 1e12 == pytest.approx(53.1e6, rel=1e-3)
    assert cache_efficiency(8e6, 20e12) * 1e12 == pytest.approx(0.4e6)


def test_io_perf_and_silod_perf_small_numbers():
    # Half cached: every byte fetched remotely yields two bytes of input.
    assert io_perf(50.0, 500.0, 1000.0) == pytest.approx(100.0)
    assert silod_perf(80.0, 50.0, 500.0, 1000.0) == pytest.approx(80.0)  # GPU bound
    assert silod_perf(120.0, 50.0, 500.0, 1000.0) == pytest.approx(100.0)  # IO bound
    assert hit_ratio(250.0, 1000.0) == pytest.approx(0.25)
    assert hit_ratio(5000.0, 1000.0) == 1.0  # clipped: cache beyond the dataset is not a hit


def test_dataset_cache_efficiency_is_sum_over_readers():
    # Two jobs at 100 and 50 B/s on a 1000 B dataset: (100 + 50) / 1000 = 0.15.
    assert dataset_cache_efficiency([100.0, 50.0], 1000.0) == pytest.approx(0.15)
    assert dataset_cache_efficiency([], 1000.0) == 0.0
    effs = dataset_cache_efficiencies({"a": [100.0, 50.0], "b": [10.0]}, {"a": 1000.0, "b": 10.0})
    assert effs == pytest.approx({"a": 0.15, "b": 1.0})
    with pytest.raises(ValueError, match="c"):
        dataset_cache_efficiencies({"c": [1.0]}, {"a": 1.0})


# ---------------------------------------------------------------------------------------------
# Monotonicity and saturation


@FAST
@given(f=pos_rates, d=sizes, b1=rates, b2=rates, h1=fractions, h2=fractions)
def test_silod_perf_monotone_in_remote_io_and_cache(f, d, b1, b2, h1, h2):
    lo_b, hi_b = sorted((b1, b2))
    lo_c, hi_c = sorted((h1 * d, h2 * d))
    for c in (lo_c, hi_c):
        assert silod_perf(f, lo_b, c, d) <= silod_perf(f, hi_b, c, d)
        assert io_perf(lo_b, c, d) <= io_perf(hi_b, c, d)
    for b in (lo_b, hi_b):
        assert silod_perf(f, b, lo_c, d) <= silod_perf(f, b, hi_c, d) * (1 + 1e-12)
        assert io_perf(b, lo_c, d) <= io_perf(b, hi_c, d) * (1 + 1e-12)
    # More cache never needs more remote IO; a faster job never needs less.
    assert remote_demand(f, hi_c, d) <= remote_demand(f, lo_c, d)
    assert remote_demand(f, lo_c, d) <= remote_demand(f * 2, lo_c, d)


@FAST
@given(f=pos_rates, d=sizes, h=fractions, extra=st.floats(min_value=0.0, max_value=10.0))
def test_silod_perf_reaches_ideal_exactly_at_remote_demand(f, d, h, extra):
    c = h * d
    need = remote_demand(f, c, d)
    assert need == pytest.approx(f * (1 - c / d), rel=1e-12, abs=1e-9)
    # At or above the demand the job runs at f*, and never faster.
    assert silod_perf(f, need * (1 + extra), c, d) == pytest.approx(f, rel=1e-9)
    assert silod_perf(f, need * (1 + extra) + 1e12, c, d) == pytest.approx(f, rel=1e-12)
    # Strictly below the demand (when there is a miss at all) the job is IO-bound: b / (1 - c/d).
    if need > 0 and h < 1 - 1e-9:
        b = need * 0.5
        assert silod_perf(f, b, c, d) == pytest.approx(b / (1 - c / d), rel=1e-9)
        assert silod_perf(f, b, c, d) < f


@FAST
@given(b=rates, d=sizes, over=st.floats(min_value=1.0, max_value=100.0), f=pos_rates)
def test_io_perf_unbounded_when_fully_cached(b, d, over, f):
    c = d * over
    assert io_perf(b, c, d) == math.inf
    assert silod_perf(f, b, c, d) == f
    assert remote_demand(f, c, d) == 0.0
    assert hit_ratio(c, d) == 1.0


def test_io_perf_zero_remote_io_uncached_is_zero():
    assert io_perf(0.0, 0.0, 100.0) == 0.0
    assert silod_perf(100.0, 0.0, 0.0, 100.0) == 0.0


@FAST
@given(f=pos_rates, d1=sizes, d2=sizes)
def test_cache_efficiency_is_minus_derivative_of_demand(f, d1, d2):
    # -db/dc = f*/d: taking a finite step dc of cache saves exactly f*/d * dc of remote IO.
    d = max(d1, d2)
    dc = min(d1, d2) / 2
    saved = remote_demand(f, 0.0, d) - remote_demand(f, dc, d)
    assert saved == pytest.approx(cache_efficiency(f, d) * dc, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# Vectorisation


@FAST
@given(
    st.lists(st.tuples(pos_rates, rates, st.floats(0.0, 2.0), sizes), min_size=1, max_size=20),
)
def test_vectorised_equals_scalar(rows):
    f = np.array([r[0] for r in rows])
    b = np.array([r[1] for r in rows])
    d = np.array([r[3] for r in rows])
    c = np.array([r[2] for r in rows]) * d  # up to twice the dataset: includes fully cached rows
    vec = {
        "silod_perf": silod_perf(f, b, c, d),
        "io_perf": io_perf(b, c, d),
        "remote_demand": remote_demand(f, c, d),
        "cache_efficiency": cache_efficiency(f, d),
        "hit_ratio": hit_ratio(c, d),
    }
    for name, arr in vec.items():
        assert isinstance(arr, np.ndarray) and arr.shape == f.shape, name
    for i in range(len(rows)):
        scal = {
            "silod_perf": silod_perf(f[i], b[i], c[i], d[i]),
            "io_perf": io_perf(b[i], c[i], d[i]),
            "remote_demand": remote_demand(f[i], c[i], d[i]),
            "cache_efficiency": cache_efficiency(f[i], d[i]),
            "hit_ratio": hit_ratio(c[i], d[i]),
        }
        for name, value in scal.items():
            assert isinstance(value, float), name
            assert vec[name][i] == value, (name, i)


def test_broadcasting_scalar_with_array():
    out = silod_perf(np.array([10.0, 100.0, 1000.0]), 50.0, 0.0, 1e3)
    np.testing.assert_allclose(out, [10.0, 50.0, 50.0])
    out = io_perf(10.0, np.array([0.0, 500.0, 1000.0]), 1000.0)
    np.testing.assert_allclose(out, [10.0, 20.0, np.inf])


# ---------------------------------------------------------------------------------------------
# Invalid input


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: silod_perf(-1.0, 1.0, 0.0, 1.0), "ideal"),
        (lambda: silod_perf(1.0, -1.0, 0.0, 1.0), "remote_io"),
        (lambda: silod_perf(1.0, 1.0, -5.0, 1.0), "cache"),
        (lambda: silod_perf(1.0, 1.0, 0.0, -1.0), "dataset_size"),
        (lambda: silod_perf(1.0, 1.0, 0.0, 0.0), "dataset_size"),
        (lambda: silod_perf(float("nan"), 1.0, 0.0, 1.0), "ideal"),
        (lambda: silod_perf(1.0, float("nan"), 0.0, 1.0), "remote_io"),
        (lambda: silod_perf(1.0, 1.0, float("nan"), 1.0), "cache"),
        (lambda: silod_perf(1.0, 1.0, 0.0, float("nan")), "dataset_size"),
        (lambda: io_perf(-1.0, 0.0, 1.0), "remote_io"),
        (lambda: io_perf(1.0, 0.0, 0.0), "dataset_size"),
        (lambda: remote_demand(-1.0, 0.0, 1.0), "ideal"),
        (lambda: remote_demand(1.0, -1.0, 1.0), "cache"),
        (lambda: remote_demand(1.0, 0.0, 0.0), "dataset_size"),
        (lambda: cache_efficiency(1.0, 0.0), "dataset_size"),
        (lambda: cache_efficiency(-1.0, 1.0), "ideal"),
        (lambda: cache_efficiency(float("nan"), 1.0), "ideal"),
        (lambda: dataset_cache_efficiency([1.0, -2.0], 1.0), "ideal"),
        (lambda: dataset_cache_efficiency([1.0], 0.0), "dataset_size"),
        (lambda: dataset_cache_efficiency([1.0], float("nan")), "dataset_size"),
        (lambda: silod_perf(np.array([1.0, 2.0]), np.array([1.0, -3.0]), 0.0, 1.0), "remote_io"),
        (lambda: silod_perf(1.0, 1.0, 0.0, np.array([1.0, 0.0])), "dataset_size"),
    ],
)
def test_invalid_input_raises_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        call()


def test_negative_value_is_quoted():
    with pytest.raises(ValueError, match=r"-3\.0"):
        silod_perf(1.0, -3.0, 0.0, 1.0)


# ---------------------------------------------------------------------------------------------
# Units


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("143GB", 143e9),
        ("1.3TB", 1.3e12),
        ("1.3 TB", 1.3e12),
        ("512MiB", 512 * 2**20),
        ("4GiB", 4 * 2**30),
        ("2TiB", 2 * 2**40),
        ("1KiB", 1024),
        ("1kB", 1000),
        ("1KB", 1000),
        ("100B", 100),
        ("100", 100),
        ("1e9", 1e9),
        ("1.5e3MB", 1.5e9),
        ("4G", 4e9),  # bare prefix reads as bytes
        ("8Gbit", 1e9),  # bits only where the unit says bits
        ("8Gbits", 1e9),
        ("4gB", 4e9),  # the prefix's case does not matter, the B's does
        ("0", 0),
        (" 7 GB ", 7e9),
        (42, 42.0),
        (2.5, 2.5),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("200MB/s", 200e6),
        ("1.5GB/s", 1.5e9),
        ("100MiB/s", 100 * 2**20),
        ("1Gbps", 1e9 / 8),
        ("8Gbps", 1e9),
        ("1.6Gbps", 200e6),  # the paper's micro-benchmark link
        ("32Gbps", 4e9),
        ("1Gbit/s", 1e9 / 8),
        ("1Gbits/s", 1e9 / 8),
        ("10gbps", 1.25e9),
        ("300bps", 37.5),
        ("1GBps", 1e9),
        ("1GB/sec", 1e9),
        ("1GB/S", 1e9),
        ("5e8", 5e8),
        ("300/s", 300),
        ("4 GB/s", 4e9),
        (114e6, 114e6),
    ],
)
def test_parse_rate(text, expected):
    assert parse_rate(text) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("-1GB", "negative"),
        ("-5", "negative"),
        (-5, "negative"),
        ("12XB", "unknown unit"),
        ("12 parsecs", "unknown unit"),  # "parsecs" is read as a prefix, and there is no such prefix
        ("", "not a size"),
        ("   ", "not a size"),
        ("GB", "not a size"),
        ("1.2.3GB", "not a size"),
        ("abc", "not a size"),
        ("5GBps", "rate, not a size"),
        ("10tb", "ambiguous"),
        ("10Gb", "ambiguous"),
        ("100b", "ambiguous"),
        (float("nan"), "not a finite"),
        (float("inf"), "not a finite"),
        ("1e400", "not a finite"),
        (True, "not a size"),
    ],
)
def test_parse_size_errors(text, fragment):
    with pytest.raises(UnitError, match=fragment) as info:
        parse_size(text, what="--cache")
    assert isinstance(info.value, UserError)  # CLI/REST turn it into a clear message
    assert "--cache" in str(info.value)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("-200MB/s", "negative"),
        ("200MB", "no time unit"),
        ("200XB/s", "unknown unit"),
        ("", "not a rate"),
        ("fast", "no time unit|not a rate|unknown unit"),
        ("MB/s", "not a rate"),
        ("1/2GB/s", "not a rate"),
        (float("nan"), "not a finite"),
        (False, "not a rate"),
    ],
)
def test_parse_rate_errors(text, fragment):
    with pytest.raises(UnitError, match=fragment) as info:
        parse_rate(text, what="--remote-io")
    assert "--remote-io" in str(info.value)


@pytest.mark.parametrize(
    ("text", "parse", "readings"),
    [
        ("10tb", parse_size, ["10TB for 10 terabytes (10TB)", "10Tbit for 10 terabits (1.25TB)"]),
        ("10Gb", parse_size, ["10GB for 10 gigabytes (10GB)", "10Gbit for 10 gigabits (1.25GB)"]),
        ("4Gib", parse_size, ["4GiB for 4 gibibytes", "4Gibit for 4 gibibits"]),
        ("10Gb/s", parse_rate, ["10GB/s for 10 gigabytes/s (10GB/s)", "10Gbps for 10 gigabits/s (1.25GB/s)"]),
        ("100mb/s", parse_rate, ["100MB/s for 100 megabytes/s", "100Mbps for 100 megabits/s (12.5MB/s)"]),
        ("1Gps", parse_rate, ["1GB/s for 1 gigabytes/s", "1Gbps for 1 gigabits/s (125MB/s)"]),
    ],
)
def test_a_lower_case_b_is_refused_with_both_readings(text, parse, readings):
    """`10tb` was 10 terabits (1.25e12 bytes), silently: an 8x error nothing downstream shows."""
    with pytest.raises(UnitError, match="ambiguous") as info:
        parse(text, what="--cache")
    message = str(info.value)
    assert "--cache" in message and repr(text) in message
    for reading in readings:
        assert reading in message, message


@FAST
@given(st.one_of(st.integers(0, 999).map(float), st.floats(min_value=1e3, max_value=1e17)))
def test_format_size_roundtrips_to_three_digits(x):
    # Below 1 KB sizes print as whole bytes; above, with three significant digits.
    assert parse_size(format_size(x)) == pytest.approx(x, rel=5e-3)
    if x <= 9.9e12:  # rates are bounded at 10 TB/s (estimator.units.MAX_RATE_BYTES_PER_S)
        assert parse_rate(format_rate(x)) == pytest.approx(x, rel=5e-3)


@FAST
@given(st.floats(min_value=0.0, max_value=1e6), st.sampled_from(["K", "M", "G", "T", "P"]))
def test_binary_units_are_powers_of_1024(x, prefix):
    power = "KMGTP".index(prefix) + 1
    # Within the bounds of estimator.units (sizes <= 1 EB, rates <= 10 TB/s; tests/test_bounds.py).
    if x * 1024**power <= 1e18:
        assert parse_size(f"{x!r}{prefix}iB") == pytest.approx(x * 1024**power, rel=1e-12)
        assert parse_size(f"{x!r}{prefix}B") == pytest.approx(x * 1000**power, rel=1e-12)
    if x * 1000**power / 8 <= 1e13:
        assert parse_rate(f"{x!r}{prefix}bps") == pytest.approx(x * 1000**power / 8, rel=1e-12)


def test_format_inf_rate():
    assert format_rate(math.inf) == "inf"
