"""What every benchmark's chart does before and after drawing: matplotlib on the Agg backend, then save."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot drawing to files, or None (said on stdout) when the bench extra is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'); no chart written")
        return None
    return plt


def finish(fig, path: Path, axes=(), legend_fontsize: float | None = 8, dpi: int = 110) -> Path:
    """Grid (and legend) on the given axes, then write the figure to path and free it."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        if legend_fontsize is not None:
            ax.legend(fontsize=legend_fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
