"""Pictures of the trade-off: quality against expected time reduction per exit policy (as MuE's Figures 1 and 4),
and captions with each token coloured by the decoder layer it exited at (as BLIPEE's Figure 3). Image files drawn
with matplotlib's `Figure` alone: no pyplot, so a notebook's backend is left as it is."""

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .calibration import OperatingPoint, pareto_frontier
from .loading import check_writable

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def new_figure(**options: Any) -> "Figure":
    """A matplotlib `Figure` (`figsize=...`), drawn and saved without pyplot or a global backend."""
    from matplotlib.figure import Figure

    return Figure(**options)


def save(figure: "Figure", path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path


def percent_of(point: OperatingPoint, full: OperatingPoint) -> float:
    """A point's quality as a percentage of the full model's (0 when the full model scores 0)."""
    return 100 * point.quality / full.quality if full.quality else 0.0


def policy_of(settings: dict[str, Any]) -> str:
    """A label for a setting's family: the decoder policy, and whether the encoder exits too."""
    encoder = any(name.startswith("encoder") for name in settings)
    if "exit_threshold" not in settings:
        return "encoder exits only"
    return f"decoder {settings.get('exit_policy', 'similarity')}" + (" + encoder" if encoder else "")


def check_plot_path(path: str | Path, option: str = "--plot") -> None:
    """ValueError, naming the command-line `option` that gave `path`, unless matplotlib can write an image of its
    kind (its suffix) there: a file, in a folder that exists or can be made, that this process may write."""
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    target = Path(path)
    if target.suffix.lstrip(".").lower() not in kinds or target.is_dir():
        raise ValueError(f"{option} {path}: name an image file, one of {sorted(kinds)} (e.g. tradeoff.png).")
    check_writable(target, option)


def tradeoff_plot(
    sweeps: dict[str, tuple[OperatingPoint, Sequence[OperatingPoint]]],
    path: str | Path,
    chosen: dict[str, Any] | None = None,
    tolerance: float | None = None,
) -> Path:
    """One panel per task: every swept point as (expected time reduction %, quality % of the full model), the
    Pareto frontier of each policy family, the full model at (0, 100), the `chosen` setting circled and, with a
    `tolerance` (the quality share a setting may lose), the line it must stay above."""
    figure = new_figure(figsize=(5.2 * len(sweeps), 4.2))
    axes = figure.subplots(1, len(sweeps), squeeze=False)
    for axis, (task, (full, points)) in zip(axes[0], sweeps.items(), strict=True):
        families: dict[str, list[OperatingPoint]] = {}
        for point in points:
            families.setdefault(policy_of(point.settings), []).append(point)
        for family, members in sorted(families.items()):
            relative = [percent_of(p, full) for p in members]
            scatter = axis.scatter([100 * p.expected_time_reduction for p in members], relative, s=12, alpha=0.35)
            frontier = pareto_frontier(members)
            axis.plot(
                [100 * p.expected_time_reduction for p in frontier],
                [percent_of(p, full) for p in frontier],
                color=scatter.get_facecolor()[0][:3],
                label=family,
                marker="o",
                markersize=3,
            )
            for point in members:
                if chosen is not None and point.settings == chosen:
                    axis.scatter(
                        [100 * point.expected_time_reduction],
                        [percent_of(point, full)],
                        s=160,
                        facecolors="none",
                        edgecolors="black",
                        label="chosen",
                    )
        axis.scatter([0], [100], marker="*", s=160, color="black", label="full model")
        if tolerance is not None:
            axis.axhline(100 * (1 - tolerance), color="grey", linestyle=":", linewidth=1, label="tolerance")
        axis.set_title(f"{task} (full model {full.quality:.3f})")
        axis.set_xlabel("expected time reduction (%)")
        axis.set_ylabel("quality (% of the full model)")
        axis.set_ylim(bottom=max(0, axis.get_ylim()[0]))
        axis.legend(fontsize=7, loc="lower left")
    return save(figure, path)


def exit_picture(captions: Sequence[Sequence[tuple[str, int]]], decoder_layers: int, path: str | Path) -> Path:
    """Each caption as a row of its tokens, each on a box coloured by the decoder layer it exited at."""
    import matplotlib
    from matplotlib.patches import Rectangle

    colours = matplotlib.colormaps["viridis"].resampled(decoder_layers)
    width = max(sum(max(len(token), 2) + 1 for token, _ in caption) for caption in captions)
    figure = new_figure(figsize=(max(6.0, 0.13 * width), 0.55 * len(captions) + 0.9))
    axis = figure.subplots()
    for row, caption in enumerate(captions):
        x = 0.0
        for token, layer in caption:
            size = max(len(token), 2) + 1
            axis.add_patch(Rectangle((x, -row - 0.4), size - 0.2, 0.8, color=colours(layer - 1), alpha=0.85))
            axis.text(x + (size - 0.2) / 2, -row, token, ha="center", va="center", fontsize=8, color="white")
            x += size
    axis.set_xlim(0, width)
    axis.set_ylim(-len(captions) + 0.4, 0.6)
    axis.axis("off")
    handles = [Rectangle((0, 0), 1, 1, color=colours(layer)) for layer in range(decoder_layers)]
    axis.legend(
        handles,
        [f"exit after layer {layer + 1}" for layer in range(decoder_layers)],
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=decoder_layers,
        fontsize=7,
        frameon=False,
    )
    return save(figure, path)


__all__ = ["exit_picture", "new_figure", "policy_of", "save", "tradeoff_plot"]
