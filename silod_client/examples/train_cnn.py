"""A real PyTorch training job: a small CNN on JPEG images, read through silod's mount.

    python -m silod_client.examples.train_cnn --epochs 3 [--data DIR] [--workers 2] [--stats FILE]

It is what a user's script looks like under silod: the dataset is a directory (the job's mount,
$SILOD_DATA, on the local backend; the CSI volume on Kubernetes), images are decoded with Pillow
in a torch DataLoader with several worker processes, the model trains on the CPU, and the step
times are reported through `silod_client.reporter` (a no-op outside silod). Needs torch (the
`torch` extra) and Pillow; not torchvision.

Labels are the image's directory name (any number of classes), or 10 classes by file order when
the images lie in one directory. `--stats FILE` writes after every epoch a JSON record of each
epoch's seconds, source bytes and items, and the mean compute time per step (what the job
reported), for benchmarks (benchmarks/bench_pytorch_estimator.py).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from pathlib import Path

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".JPG", ".JPEG")


def list_images(root: Path) -> list[Path]:
    files = sorted(p for p in root.rglob("*") if p.suffix in IMAGE_EXTENSIONS and p.is_file())
    if not files:
        raise SystemExit(f"error: no JPEG images under {root} (give --data DIR, or run under silod with SILOD_DATA)")
    return files


def build(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    root = Path(args.data)
    files = list_images(root)
    dirs = sorted({p.parent for p in files})
    labels = ({d: i for i, d in enumerate(dirs)} if len(dirs) > 1 else None)
    size = args.image_size

    class Jpegs(Dataset):
        """(image tensor, label, source bytes, seconds the worker waited for them): the bytes are
        what the mount served for it."""

        def __len__(self) -> int:
            return len(files)

        def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
            from PIL import Image

            t0 = time.perf_counter()  # the worker's wait for the bytes (a miss: the mount's fetch)
            with open(files[i], "rb") as f:
                raw = f.read()
            read_s = time.perf_counter() - t0
            img = Image.open(io.BytesIO(raw)).convert("RGB").resize((size, size))
            x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(size, size, 3)
            x = x.permute(2, 0, 1).float().div_(255.0)
            label = labels[files[i].parent] if labels is not None else i % 10
            return x, label, len(raw), read_s

    classes = len(dirs) if labels is not None else 10
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * (size // 4) * (size // 4), classes),
    )
    loader = DataLoader(Jpegs(), batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        persistent_workers=args.workers > 0, prefetch_factor=args.prefetch if args.workers > 0 else None,
                        drop_last=False, in_order=not args.out_of_order)
    return model, loader


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=os.environ.get("SILOD_DATA"), help="the dataset directory [env SILOD_DATA]")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--prefetch", type=int, default=2, help="batches each worker loads ahead")
    p.add_argument("--out-of-order", action="store_true",
                   help="hand batches to the loop as workers finish them (torch's in_order=False), not in sampler order")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for the model")
    p.add_argument("--stats", default=None, help="write per-epoch figures (JSON) here")
    p.add_argument("--report-interval", type=float, default=5.0, help="seconds between step reports to silod")
    return p


class Trainer:
    """The model, its DataLoader and optimiser; `epoch()` trains one epoch and returns its record
    {"epoch", "seconds", "bytes", "items", "steps", "compute_s_per_step", "read_s" (the workers'
    summed seconds in open + read of its items), "loss", "reports_sent", "reports_failed"}."""

    def __init__(self, args: argparse.Namespace):
        import torch
        from torch import nn

        from silod_client.reporter import StepReporter

        torch.set_num_threads(max(1, args.threads))
        torch.manual_seed(0)
        self.model, self.loader = build(args)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        self.loss_fn = nn.CrossEntropyLoss()
        self.reporter = StepReporter(interval=args.report_interval)
        self.records: list[dict] = []

    def epoch(self) -> dict:
        t0 = time.perf_counter()
        nbytes = items = steps = 0
        compute = loss_value = 0.0
        read_s = 0.0
        for x, y, raw, waited in self.reporter.wrap(self.loader, batch_bytes=lambda b: int(b[2].sum())):
            c0 = time.perf_counter()
            self.opt.zero_grad()
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
            self.opt.step()
            compute += time.perf_counter() - c0
            loss_value = loss.item()
            nbytes += int(raw.sum())
            read_s += float(waited.sum())
            items += len(y)
            steps += 1
        seconds = time.perf_counter() - t0
        record = {"epoch": len(self.records), "seconds": seconds, "bytes": nbytes, "items": items, "steps": steps,
                  "compute_s_per_step": compute / max(steps, 1), "read_s": read_s, "loss": loss_value,
                  "reports_sent": self.reporter.sent, "reports_failed": self.reporter.failed}
        self.records.append(record)
        return record

    def close(self) -> None:
        self.reporter.close()
        del self.loader  # its persistent workers exit now, not at interpreter exit


def train(args: argparse.Namespace, on_epoch=None) -> list[dict]:  # type: ignore[no-untyped-def]
    """Train for `args.epochs` epochs; the per-epoch records (Trainer.epoch), also handed to
    `on_epoch(records)` after each epoch."""
    trainer = Trainer(args)
    try:
        for _ in range(args.epochs):
            trainer.epoch()
            if on_epoch is not None:
                on_epoch(trainer.records)
    finally:
        trainer.close()
    return trainer.records


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if not args.data:
        p.error("give --data DIR or run under silod (SILOD_DATA)")
    if args.epochs < 1 or args.batch_size < 1 or args.workers < 0 or args.image_size < 4:
        p.error("--epochs and --batch-size must be >= 1, --workers >= 0, --image-size >= 4")

    def on_epoch(epochs: list[dict]) -> None:
        e = epochs[-1]
        print(f"epoch {e['epoch']}: {e['seconds']:.2f}s, {e['bytes'] / e['seconds'] / 1e6:.2f} MB/s, {e['items']} images,"
              f" loss {e['loss']:.3f}", flush=True)
        if args.stats:
            tmp = f"{args.stats}.tmp"
            Path(tmp).write_text(json.dumps({"epochs": epochs}))
            os.replace(tmp, args.stats)

    train(args, on_epoch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
