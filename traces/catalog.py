"""Models and datasets from the SiloD paper, with the source of every figure.

A trace row or an API request that names a model but gives no ideal throughput gets f* from
here; one that names a dataset but gives no size gets the size from here. Throughputs are per
V100 GPU (the paper's reference GPU) in bytes/s; multi-GPU jobs scale linearly, as the paper's
Table 2 does to within 3% (8 x V100: 888 MB/s vs 8 x 114 MB/s).
"""

from __future__ import annotations

from dataclasses import dataclass

from estimator.errors import UserError
from estimator.pipeline import InputPipeline

MB = 1e6
GB = 1e9
TB = 1e12


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    ideal_per_gpu: float  # f* on one V100, bytes/s
    dataset: str  # the dataset the paper trains it on
    source: str
    #: Source bytes/s one CPU core preprocesses for this model's input pipeline; None = not
    #: CPU-bound. Preprocessing depends on the data, not on the model, so image models share
    #: the ImageNet JPEG pipeline's rate.
    cpu_rate: float | None = None
    cpu_source: str = ""

    @property
    def pipeline(self) -> InputPipeline | None:
        """The catalog's input pipeline for this model (no autocache point: no measured
        post-decode rate is published for these pipelines)."""
        return None if self.cpu_rate is None else InputPipeline(self.cpu_rate)


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    name: str
    size: float  # bytes
    item_size: float  # typical bytes per item (file), for chunking and the demo
    source: str


DATASETS: dict[str, DatasetSpec] = {
    d.name: d
    for d in (
        DatasetSpec("imagenet-22k", 1.36 * TB, 110e3, "SiloD Table 4 (1.36 TB)"),
        DatasetSpec("imagenet-1k", 143 * GB, 110e3, "SiloD Table 4 and §6 (143 GB)"),
        DatasetSpec("openimages", 660 * GB, 110e3, "SiloD Table 4 (660 GB)"),
        DatasetSpec("youtube-8m", 1.46 * TB, 1.5e6, "SiloD Table 4 (1.46 TB)"),
        DatasetSpec("web-search", 20.9 * TB, 1e6, "SiloD Table 4 and §7.1.1 (20.9 TB)"),
        DatasetSpec("synthetic-1.3tb", 1.3 * TB, 110e3, "SiloD §7.1.1 (four 1.3 TB synthesized image sets)"),
    )
}

#: Plumber (MLSys'22) §5.1: the ResNet/ImageNet pipeline's JPEG decode serves 2.5 minibatches/s
#: per core (its Setup A, AMD 2700X); §5.2: a minibatch is 128 records of ~110 KB. 2.5 x 128 x
#: 110 KB = 35.2 MB/s per core, so a V100 at 114 MB/s needs 3.2 cores (Cachew Fig. 1 reports
#: 4 to 12 cores per accelerator core for image pipelines, the same order).
IMAGENET_JPEG_CPU_RATE = 2.5 * 128 * 110e3
_JPEG = "Plumber §5.1-5.2: JPEG decode 2.5 minibatches/s/core x 128 x 110 KB = 35.2 MB/s per core"
_NOT_CPU = "not CPU-bound (precomputed features / tokenised text; no decode stage): assumption, no published per-core rate"

MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("resnet50", 114 * MB, "imagenet-22k", "SiloD Fig. 6 and Table 2 (1 x V100: 1003 images/s, 114 MB/s)",
                  IMAGENET_JPEG_CPU_RATE, _JPEG),
        ModelSpec("resnet152", 43 * MB, "imagenet-22k", "SiloD Fig. 6 (43 MB/s on a V100)", IMAGENET_JPEG_CPU_RATE, _JPEG),
        ModelSpec("efficientnetb1", 69 * MB, "imagenet-22k", "SiloD Fig. 6 (69 MB/s on a V100)", IMAGENET_JPEG_CPU_RATE, _JPEG),
        ModelSpec("vlad", 10 * MB, "youtube-8m", "SiloD Fig. 6 (10 MB/s on a V100)", None, _NOT_CPU),
        ModelSpec("bert", 2 * MB, "web-search", "SiloD Fig. 6 (2 MB/s on a V100; §7.1.1: 8 MB/s on 4 GPUs)", None, _NOT_CPU),
    )
}


def lookup_model(name: str) -> ModelSpec:
    key = name.strip().lower().replace("-", "").replace("_", "")
    for spec in MODELS.values():
        if spec.name.replace("-", "") == key:
            return spec
    raise UserError(
        f"unknown model {name!r}; give ideal_throughput explicitly or use one of: {', '.join(sorted(MODELS))}"
    )


def lookup_dataset(name: str) -> DatasetSpec:
    if name in DATASETS:
        return DATASETS[name]
    raise UserError(f"unknown dataset {name!r} and no size given; give dataset_size or use one of: {', '.join(sorted(DATASETS))}")


def ideal_throughput(model: str, gpus: int) -> float:
    """f* of `model` on `gpus` V100s (bytes/s), linear in the GPU count."""
    return lookup_model(model).ideal_per_gpu * gpus
