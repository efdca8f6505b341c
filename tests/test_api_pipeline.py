"""The input-pipeline fields over REST: job fields in and out, cores allocated per job, and the
bottleneck diagnosis of GET /v1/jobs/{id} (real SQLite file, real rounds of the service)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

try:
    from test_api import H_ADMIN, H_ALICE, IMAGENET, make_app
except ImportError:  # tests/ imported as a package
    from tests.test_api import H_ADMIN, H_ALICE, IMAGENET, make_app

JOB = {"name": "r50", "gpus": 1, "dataset": "imagenet", "epochs": 2, "ideal_throughput": "100MB/s"}


@pytest.fixture
def cpu_client(tmp_path):
    # 8 GPUs in 2 nodes of 4, 4 cores per node: 8 cores in all.
    app, service = make_app(f"sqlite:///{tmp_path / 'api.db'}", tmp_path, run_loop=False, cpus_per_node="4")
    with TestClient(app) as c:
        assert c.post("/v1/datasets", json=IMAGENET, headers=H_ALICE).status_code == 201
        yield c, service
    service.close()


def test_fields_round_trip_and_catalog_default(cpu_client):
    c, _ = cpu_client
    r = c.post("/v1/jobs", json={**JOB, "cpu_rate": "35MB/s", "autocache_expansion": 6, "post_cpu_rate": "350MB/s"}, headers=H_ALICE)
    assert r.status_code == 201, r.text
    body = r.json()
    assert (body["cpu_rate"], body["autocache_expansion"], body["post_cpu_rate"]) == (35e6, 6.0, 350e6)
    # A catalog model without cpu_rate gets the catalog's (Plumber's JPEG decode rate) ...
    r = c.post("/v1/jobs", json={"name": "m", "gpus": 1, "dataset": "imagenet", "epochs": 1, "model": "resnet50"}, headers=H_ALICE)
    assert r.json()["cpu_rate"] == pytest.approx(35.2e6)
    # ... and an explicit null says "not CPU-bound".
    r = c.post("/v1/jobs", json={"name": "n", "gpus": 1, "dataset": "imagenet", "epochs": 1, "model": "resnet50", "cpu_rate": None},
               headers=H_ALICE)
    assert r.json()["cpu_rate"] is None
    assert c.get(f"/v1/jobs/{body['id']}", headers=H_ALICE).json()["cpu_rate"] == 35e6


@pytest.mark.parametrize("patch,fragment", [
    ({"cpu_rate": "-1MB/s"}, "cpu_rate"),
    ({"cpu_rate": "fast"}, "cpu_rate"),
    ({"cpu_rate": "35MB/s", "autocache_expansion": 6}, "post_cpu_rate"),
    ({"cpu_rate": "35MB/s", "autocache_expansion": 6, "post_cpu_rate": "1MB/s"}, ">= cpu_rate"),
    ({"cpu_rate": "35MB/s", "autocache_expansion": 0, "post_cpu_rate": "350MB/s"}, "autocache_expansion"),
    ({"autocache_expansion": 6, "post_cpu_rate": "350MB/s"}, "cpu_rate"),
])
def test_bad_pipeline_fields_are_422(cpu_client, patch, fragment):
    c, _ = cpu_client
    r = c.post("/v1/jobs", json={**JOB, **patch}, headers=H_ALICE)
    assert r.status_code == 422, r.text
    assert fragment in r.text


def test_running_job_shows_cores_and_bottleneck(cpu_client):
    c, service = cpu_client
    # 100 MB/s at 35 MB/s per core needs 2.86 cores; its node has 4: it gets 2.86 and is not
    # CPU-bound. 143 GB, 200 GB cache: all of it cached eventually, IO planned on what is cached.
    cpu_job = c.post("/v1/jobs", json={**JOB, "cpu_rate": "35MB/s"}, headers=H_ALICE).json()
    # A second image job, 4 GPUs, 400 MB/s: needs 11.4 cores, its node has 4.
    big = c.post("/v1/jobs", json={**JOB, "name": "big", "gpus": 4, "ideal_throughput": "400MB/s", "cpu_rate": "35MB/s"},
                 headers=H_ALICE).json()
    service.run_round("test")
    one = c.get(f"/v1/jobs/{cpu_job['id']}", headers=H_ALICE).json()
    two = c.get(f"/v1/jobs/{big['id']}", headers=H_ALICE).json()
    assert one["state"] == two["state"] == "running"
    assert one["allocated_cpus"] == pytest.approx(100 / 35)
    assert two["allocated_cpus"] == pytest.approx(4.0)  # capped by its node
    assert two["bottleneck"]["bound"] == "cpu"
    assert two["bottleneck"]["throughput"] == pytest.approx(4 * 35e6)
    assert two["bottleneck"]["speedup_cpu"] == pytest.approx(5 / 4)
    # Its 143 GB dataset has 143 GB of the 200 GB cache; with no measurement the allocation
    # counts as filled (Eq. 4): IO is no bound, its cores suffice, the GPU binds.
    assert one["bottleneck"]["bound"] == "gpu"
    # A second GPU would want 200 MB/s, but its 2.86 cores preprocess exactly 100: no gain.
    assert one["bottleneck"]["speedup_gpu"] == pytest.approx(1.0)
    assert one["bottleneck"]["speedup_cpu"] == pytest.approx(1.0)
    listed = {j["id"]: j for j in c.get("/v1/jobs", headers=H_ALICE).json()}
    assert listed[big["id"]]["allocated_cpus"] == pytest.approx(4.0)
    # The list carries the same diagnosis (`silod jobs` shows it), computed in one call for all.
    assert listed[big["id"]]["bottleneck"] == two["bottleneck"]
    assert listed[cpu_job["id"]]["bottleneck"] == one["bottleneck"]


def test_without_cpus_per_node_no_cores_are_recorded(tmp_path):
    app, service = make_app(f"sqlite:///{tmp_path / 'api.db'}", tmp_path, run_loop=False)
    with TestClient(app) as c:
        assert c.post("/v1/datasets", json=IMAGENET, headers=H_ALICE).status_code == 201
        job = c.post("/v1/jobs", json={**JOB, "cpu_rate": "35MB/s"}, headers=H_ALICE).json()
        service.run_round("test")
        got = c.get(f"/v1/jobs/{job['id']}", headers=H_ALICE).json()
        assert got["state"] == "running" and got["allocated_cpus"] is None
        assert got["bottleneck"]["speedup_cpu"] == pytest.approx(1.0)  # unconstrained cores
    service.close()


def test_metrics_count_cores_and_bottlenecks(cpu_client):
    c, service = cpu_client
    c.post("/v1/jobs", json={**JOB, "name": "big", "gpus": 4, "ideal_throughput": "400MB/s", "cpu_rate": "35MB/s"}, headers=H_ALICE)
    c.post("/v1/jobs", json={**JOB, "name": "small", "cpu_rate": "35MB/s"}, headers=H_ALICE)
    service.run_round("test")
    text = c.get("/metrics", headers=H_ADMIN).text
    assert "silod_cpus_total 8.0" in text
    assert f"silod_cpus_allocated {4 + 100 / 35}" in text
    assert 'silod_running_jobs_bound{resource="cpu"} 1.0' in text
    assert 'silod_running_jobs_bound{resource="gpu"} 1.0' in text


def test_gpu_proportional_cores_on_the_service(tmp_path):
    app, service = make_app(f"sqlite:///{tmp_path / 'api.db'}", tmp_path, run_loop=False, cpus_per_node="4",
                            cpu_allocation="gpu-proportional")
    with TestClient(app) as c:
        assert c.post("/v1/datasets", json=IMAGENET, headers=H_ALICE).status_code == 201
        job = c.post("/v1/jobs", json={**JOB, "cpu_rate": "35MB/s"}, headers=H_ALICE).json()
        service.run_round("test")
        assert c.get(f"/v1/jobs/{job['id']}", headers=H_ALICE).json()["allocated_cpus"] == pytest.approx(1.0)  # 4 cores / 4 GPUs
    service.close()


def test_autocache_choice_in_dataset_and_job_views(cpu_client):
    c, service = cpu_client
    # 4 GPUs at 400 MB/s on 4 cores (its node's) at 35 MB/s per core: 140 MB/s from source. Its
    # autocache point stores 6 bytes per source byte and leaves 350 MB/s per core of work: with
    # the 200 GB cache holding 200 / (6 x 143) = 23% of the decoded set, 4 cores give
    # 4 / (0.233/350 + 0.767/35) = 177 MB/s: preprocessed caching wins (by 0.09 of its f*).
    big = c.post("/v1/jobs", json={**JOB, "name": "big", "gpus": 4, "ideal_throughput": "400MB/s", "cpu_rate": "35MB/s",
                                   "autocache_expansion": 6, "post_cpu_rate": "350MB/s"}, headers=H_ALICE).json()
    ds = c.get("/v1/datasets/imagenet", headers=H_ALICE).json()
    assert (ds["cache_mode"], ds["cache_expansion"]) == ("source", None)  # nothing decided yet
    service.run_round("test")
    ds = c.get("/v1/datasets/imagenet", headers=H_ALICE).json()
    assert (ds["cache_mode"], ds["cache_expansion"]) == ("preprocessed", 6.0)
    got = c.get(f"/v1/jobs/{big['id']}", headers=H_ALICE).json()
    assert (got["cache_mode"], got["cache_expansion"]) == ("preprocessed", 6.0)
    # The diagnosis uses the choice. On source bytes the whole 143 GB is cached (no IO bound) and
    # the job is CPU-bound, a fifth core worth 5/4. On decoded items only 23% is cached: the IO
    # cap the policy planned (for the 140 MB/s its cores give on source bytes, at that hit
    # ratio) binds, at 140 MB/s, and a core buys nothing. (Policies plan IO for source-rate
    # cores; the link they leave spare reaches such readers by work conservation.)
    assert got["bottleneck"]["bound"] == "remote_io"
    assert got["bottleneck"]["throughput"] == pytest.approx(140e6, rel=1e-6)
    assert got["bottleneck"]["speedup_cpu"] == pytest.approx(1.0)
    # A reader without the autocache point joins: the dataset goes back to source bytes.
    c.post("/v1/jobs", json={**JOB, "name": "plain", "cpu_rate": "35MB/s"}, headers=H_ALICE)
    service.run_round("test")
    ds = c.get("/v1/datasets/imagenet", headers=H_ALICE).json()
    assert (ds["cache_mode"], ds["cache_expansion"]) == ("source", None)
