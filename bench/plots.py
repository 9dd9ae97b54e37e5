"""PNG plots of sweep results: attainment against rate per system (as DistServe's figures)
and TTFT / TPOT CDFs at one rate."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.serve import records_from_json  # noqa: E402


def plot_attainment(results: dict[str, dict[str, dict]], path: Path, target: float = 0.9) -> None:
    """``results[workload][system]`` is a sweep (``points`` with ``rate`` and ``attainment``)."""
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.8), squeeze=False)
    for ax, (workload, systems) in zip(axes[0], results.items()):
        for system, sweep in systems.items():
            rates = [p["rate"] for p in sweep["points"]]
            ax.plot(rates, [100 * p["attainment"] for p in sweep["points"]], marker="o", label=system)
        ax.axhline(100 * target, color="grey", linestyle="--", linewidth=1)
        ax.set_title(workload)
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cdfs(points: dict[str, dict], path: Path, title: str) -> None:
    """``points[system]`` is one rate point with its ``records`` (JSON rows)."""
    fig, (ttft_ax, tpot_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    for system, point in points.items():
        records = [r for r in records_from_json(point["records"]) if r.ok]
        for ax, values in ((ttft_ax, [r.ttft for r in records]), (tpot_ax, [r.tpot for r in records if r.tpot])):
            if values:
                xs = np.sort(values)
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=f"{system} ({point['rate']:.3g} req/s)")
    for ax, name in ((ttft_ax, "TTFT (s)"), (tpot_ax, "TPOT (s)")):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
