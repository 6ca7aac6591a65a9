"""``metrics.jsonl`` (appended, one JSON record per line), ``summary.json`` and ``loss.png``.

Records are only ever appended; a resume drops the records after the resumed step by writing a
new file and renaming it over the old one, so a kill at any moment loses nothing that was logged
before the checkpoint.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

from nemo_dsa.recipe.files import append_line, atomic_write


def read_metrics(path: Path) -> list[dict]:
    """The records of ``path`` (none if it does not exist); a torn last line (a kill mid-append) is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except ValueError:
            if i != len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON: {line[:80]!r}") from None
    return records


class MetricsLog:
    """The run's ``metrics.jsonl``: every record stamped with UTC wall-clock time and elapsed seconds.

    ``elapsed_s`` counts this run's time across resumes (``elapsed_before`` comes from the checkpoint).
    Only the main rank writes (``enabled``).
    """

    def __init__(self, path: Path, *, enabled: bool = True, elapsed_before: float = 0.0) -> None:
        self.path = Path(path)
        self.enabled = enabled
        self.elapsed_before = elapsed_before
        self._start = time.monotonic()
        self.tensorboard: TensorBoardScalars | None = None  # set by the recipe for logger=tensorboard

    def elapsed(self) -> float:
        return self.elapsed_before + (time.monotonic() - self._start)

    def start_fresh(self) -> None:
        if self.enabled:
            atomic_write(self.path, "")

    def keep_until(self, step: int) -> None:
        """Drop the records after ``step`` (logged after the checkpoint this run resumes from)."""
        if self.enabled:
            kept = [r for r in read_metrics(self.path) if r["step"] <= step]
            atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def log(self, record: dict) -> None:
        if self.enabled:
            stamp = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "elapsed_s": round(self.elapsed(), 3)}
            append_line(self.path, json.dumps({**record, **stamp}))
            if self.tensorboard is not None:
                self.tensorboard.write(record)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


TENSORBOARD_PACKAGE_HINT = "pip install 'nemo-dsa[tensorboard]' (or pip install tensorboard)"


def require_tensorboard() -> None:
    """Fail at once, naming the package, when ``logger=tensorboard`` cannot write."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError(f"logger=tensorboard needs the 'tensorboard' package, which is not installed: "
                         f"{TENSORBOARD_PACKAGE_HINT}")


class TensorBoardScalars:
    """The numeric fields of training records (loss, lr, grad_norm, tokens_per_s, val_loss, ...) as
    TensorBoard scalars under ``train/`` and ``val/``, at their step.

    ``purge_step``: on resume, the events an earlier run logged from this step on are dropped by
    TensorBoard, as ``metrics.jsonl`` drops its records past the checkpoint.
    """

    SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
               "tokens_per_s": "train/tokens_per_s", "val_loss": "val/loss"}

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)

    def write(self, record: dict) -> None:
        if "event" in record:
            if record["event"] == "skipped":
                self._writer.add_scalar("train/skipped_steps", record["skipped_steps"], record["step"])
            return
        for key, tag in self.SCALARS.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(tag, value, record["step"])
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def write_summary(path: Path, summary: dict) -> None:
    atomic_write(Path(path), json.dumps(summary, indent=2) + "\n")


def plot_losses(metrics_path: Path, out_path: Path, title: str) -> None:
    """Train (and validation) loss against step, as a PNG (matplotlib's Agg backend), written atomically."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    atomic_write(Path(out_path), buffer.getvalue())
