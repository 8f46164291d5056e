"""The loss curves of a training run as a PNG, drawn with matplotlib (headless: the Agg backend)."""

from __future__ import annotations

# 6.4 x 3.6 inches at 100 dpi: a 640 x 360 pixel PNG
FIGSIZE_IN = (6.4, 3.6)
DPI = 100


def write_loss_png(
    path: str,
    losses: list[float],
    val_points: list[tuple[int, float]] = (),
    title: str = "",
    log_scale: bool = False,
    resumed_at: int | None = None,
) -> None:
    """Write ``path``: the train loss of each step (``losses[i]`` is step i + 1), the validation loss at each
    evaluation (``val_points``: (step, loss) pairs) and, for a resumed run, a marker at the step it resumed from.
    Non-finite losses show as gaps. ``log_scale`` puts the loss axis on a log scale."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; a no-op if pyplot already runs on Agg
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=FIGSIZE_IN, dpi=DPI)
    try:
        ax.plot(range(1, len(losses) + 1), losses, lw=1.2, color="tab:blue", label="train (mean over ranks)")
        if val_points:
            steps, values = zip(*val_points)
            ax.plot(steps, values, "o--", lw=1, ms=4, color="tab:red", label="validation")
        if resumed_at:
            ax.axvline(resumed_at, color="0.5", ls=":", lw=1, label=f"resumed at step {resumed_at}")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (cross-entropy, nats/byte)")
        if log_scale:
            from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

            ax.set_yscale("log")
            # plain numbers at 1, 1.5, 2, 3, 4, 5 and 7 per decade: a loss range rarely spans a whole decade
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=DPI)
    finally:
        plt.close(fig)
