"""Access patterns (estimator/access.py): the curriculum pacing function against hand-computed
values, parsing and bad input, and the optional access columns of the trace CSV."""

from __future__ import annotations

import numpy as np
import pytest

from estimator.access import EPOCH, IRREGULAR, AccessKind, AccessPattern, CurriculumPacing, pacing_items, parse_access
from estimator.errors import UserError
from traces.csv_trace import TraceError, load_csv_trace, write_csv_trace

HEADER = "job_id,submit_time,num_gpus,model,dataset,dataset_size,ideal_throughput,epochs"


# --- the pacing function (Eq. 10) ---


def test_pacing_hacohen_parameters_by_hand():
    # starting_percent 0.04, alpha 1.9, step 50k, N = 1000 items:
    # 0.04*1.9^k = 0.04, 0.076, 0.1444, 0.27436, 0.521284, 0.9904396, 1.8818 -> min(., 1)
    pacing = CurriculumPacing(0.04, 1.9, 50_000, 256)
    iterations = [0, 49_999, 50_000, 99_999, 100_000, 150_000, 200_000, 250_000, 299_999, 300_000, 10**9]
    expected = [40, 40, 76, 76, 144, 274, 521, 990, 990, 1000, 1000]
    assert pacing.eligible_items(np.array(iterations), 1000).tolist() == expected
    assert pacing.full_set_iteration() == 300_000
    assert pacing.fraction(100_000) == pytest.approx(0.1444)


def test_pacing_exact_powers_of_two():
    # 0.25 * 2^floor(i/10) * 100: 25 for i in 0..9, 50 for 10..19, all 100 from 20 on.
    got = pacing_items(np.arange(0, 31), 100, 0.25, 2.0, 10)
    assert got.tolist() == [25] * 10 + [50] * 10 + [100] * 11
    assert CurriculumPacing(0.25, 2.0, 10, 1).full_set_iteration() == 20
    # Scalar in, int out.
    assert pacing_items(15, 100, 0.25, 2.0, 10) == 50
    assert isinstance(pacing_items(15, 100, 0.25, 2.0, 10), int)


def test_pacing_rounds_down_but_never_below_one_item():
    pacing = CurriculumPacing(0.04, 2.0, 1, 1)
    assert pacing.eligible_items(0, 10) == 1  # 0.4 items -> at least one
    assert pacing.eligible_items(1, 10) == 1  # 0.8
    assert pacing.eligible_items(2, 10) == 1  # 1.6 -> 1
    assert pacing.eligible_items(3, 10) == 3  # 3.2 -> 3
    # 0.1 * 10 * 1000 is 1000.0000000000001 or 999.99... in floats; either way all items.
    assert CurriculumPacing(0.1, 10.0, 1, 1).eligible_items(1, 1000) == 1000


def test_pacing_whole_set_from_the_start_and_never_overflows():
    full = CurriculumPacing(1.0, 1.0, 5, 8)
    assert full.eligible_items(np.array([0, 7, 10**12]), 33).tolist() == [33, 33, 33]
    assert full.full_set_iteration() == 0
    huge = CurriculumPacing(1e-6, 1.5, 1, 1)
    assert huge.eligible_items(10**15, 7) == 7  # alpha^k overflows to inf; min(inf, 1) = 1


def test_pacing_is_monotone_and_reaches_the_whole_set():
    rng = np.random.default_rng(3)
    for _ in range(50):
        p = CurriculumPacing(float(rng.uniform(0.01, 1.0)), float(rng.uniform(1.01, 4.0)), int(rng.integers(1, 100)), 1)
        n = int(rng.integers(1, 10_000))
        i = np.arange(0, p.full_set_iteration() + 2 * p.step)
        g = p.eligible_items(i, n)
        assert (np.diff(g) >= 0).all()
        assert g[-1] == n and g[p.full_set_iteration()] == n
        if p.full_set_iteration() > 0:
            assert p.fraction(p.full_set_iteration() - 1) < 1.0


def test_pacing_rejects_negative_iterations():
    with pytest.raises(ValueError, match="iteration"):
        CurriculumPacing(0.5, 2.0, 1, 1).fraction(-1)


# --- the pattern and its parsing ---


def test_kinds_and_regularity():
    assert EPOCH.regular and EPOCH.kind == AccessKind.EPOCH
    assert not IRREGULAR.regular
    cl = AccessPattern.curriculum_learning(0.04, 1.9, 50_000, 256)
    assert not cl.regular and cl.curriculum == CurriculumPacing(0.04, 1.9, 50_000, 256)
    assert parse_access(None) is EPOCH and parse_access("") is EPOCH and parse_access(" Epoch ") is EPOCH
    assert parse_access("irregular") is IRREGULAR
    assert parse_access("curriculum", "0.04", "1.9", "50000", "256") == cl
    assert parse_access("curriculum", 0.04, 1.9, 50000.0, 256) == cl
    assert cl.fields() == {"access": "curriculum", "starting_percent": 0.04, "alpha": 1.9, "step": 50000, "batch": 256}
    assert "alpha=1.9" in str(cl)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("sometimes",), "not an access pattern; use one of: epoch, curriculum, irregular"),
        (("curriculum", 0.04, 1.9, 50000), "missing: batch"),
        (("curriculum",), "missing: starting_percent, alpha, step, batch"),
        (("epoch", 0.04), "starting_percent only apply to access = curriculum"),
        (("irregular", None, 2.0, 10), "alpha, step only apply to access = curriculum"),
        (("curriculum", 0, 2.0, 10, 1), r"starting_percent = 0.0 must be in \(0, 1\]"),
        (("curriculum", 1.5, 2.0, 10, 1), r"starting_percent = 1.5 must be in \(0, 1\]"),
        (("curriculum", -0.1, 2.0, 10, 1), r"must be in \(0, 1\]"),
        (("curriculum", 0.5, 1.0, 10, 1), "never reaches the whole dataset"),
        (("curriculum", 0.5, 0.9, 10, 1), "never reaches the whole dataset"),
        (("curriculum", 1.0, 0.5, 10, 1), "would shrink the eligible set"),
        (("curriculum", 0.5, 0, 10, 1), "alpha = 0.0 must be > 1"),
        (("curriculum", 0.5, 2.0, 0, 1), "step = 0.0 must be >= 1"),
        (("curriculum", 0.5, 2.0, 2.5, 1), "step = 2.5 must be a whole number"),
        (("curriculum", 0.5, 2.0, 10, 0), "batch = 0.0 must be >= 1"),
        (("curriculum", 0.5, 2.0, 10, -3), "batch = -3.0 must be >= 1"),
        (("curriculum", "half", 2.0, 10, 1), "starting_percent = 'half' is not a number"),
        (("curriculum", 0.5, "nan", 10, 1), "alpha = nan is not a finite number"),
        (("curriculum", 0.5, 2.0, "inf", 1), "step = inf is not a finite number"),
    ],
)
def test_bad_access_values_name_the_field(args, match):
    with pytest.raises(UserError, match=match):
        parse_access(*args)


def test_constructors_check_the_same_rules():
    with pytest.raises(UserError, match="never reaches"):
        CurriculumPacing(0.5, 1.0, 1, 1)
    with pytest.raises(UserError, match="batch"):
        AccessPattern.curriculum_learning(0.5, 2.0, 1, 0)
    with pytest.raises(UserError, match="needs its pacing"):
        AccessPattern(AccessKind.CURRICULUM)
    with pytest.raises(UserError, match="only a curriculum pattern"):
        AccessPattern(AccessKind.IRREGULAR, CurriculumPacing(0.5, 2.0, 1, 1))


# --- the trace CSV's optional columns ---


def _write(tmp_path, text: str):
    path = tmp_path / "t.csv"
    path.write_text(text)
    return path


def test_csv_without_access_columns_is_all_epoch(tmp_path):
    trace = load_csv_trace(_write(tmp_path, f"{HEADER}\na,0,1,m,d,1GB,100MB/s,2\n"))
    assert trace.jobs[0].access is EPOCH


def test_csv_access_columns_round_trip(tmp_path):
    text = (
        f"{HEADER},access,starting_percent,alpha,step,batch\n"
        "a,0,1,m,d,1GB,100MB/s,2,,,,,\n"
        "b,1,1,m,d,1GB,100MB/s,2,curriculum,0.04,1.9,50000,256\n"
        "c,2,2,m,e,2GB,100MB/s,1,irregular,,,,\n"
        "d,3,2,m,e,2GB,100MB/s,1,epoch,,,,\n"
    )
    trace = load_csv_trace(_write(tmp_path, text))
    by_id = {j.job_id: j.access for j in trace.jobs}
    assert by_id == {"a": EPOCH, "b": AccessPattern.curriculum_learning(0.04, 1.9, 50000, 256), "c": IRREGULAR, "d": EPOCH}
    out = tmp_path / "out.csv"
    write_csv_trace(trace, out)
    assert load_csv_trace(out).jobs == trace.jobs
    assert out.read_text().splitlines()[0].endswith(",access,starting_percent,alpha,step,batch")


def test_csv_writer_keeps_the_plain_header_for_epoch_traces(tmp_path):
    trace = load_csv_trace(_write(tmp_path, f"{HEADER},access\na,0,1,m,d,1GB,100MB/s,2,epoch\n"))
    out = tmp_path / "out.csv"
    write_csv_trace(trace, out)
    assert out.read_text().splitlines()[0] == HEADER


@pytest.mark.parametrize(
    ("row", "column", "match"),
    [
        ("curriculum,0.04,1.9,50000,", "access", "missing: batch"),
        ("curriculum,1.2,1.9,50000,8", "starting_percent", r"must be in \(0, 1\]"),
        ("curriculum,0.2,1,50000,8", "alpha", "never reaches the whole dataset"),
        ("curriculum,0.2,2,0,8", "step", "must be >= 1"),
        ("curriculum,0.2,2,10,0", "batch", "must be >= 1"),
        ("lru,,,,", "access", "not an access pattern"),
        ("epoch,0.5,,,", "starting_percent", "only apply to access = curriculum"),
    ],
)
def test_csv_bad_access_names_file_line_and_column(tmp_path, row, column, match):
    path = _write(tmp_path, f"{HEADER},access,starting_percent,alpha,step,batch\na,0,1,m,d,1GB,100MB/s,2,,,,,\nb,0,1,m,d,1GB,100MB/s,2,{row}\n")
    with pytest.raises(TraceError, match=match) as err:
        load_csv_trace(path)
    assert f"line 3, column {column!r}" in str(err.value)
