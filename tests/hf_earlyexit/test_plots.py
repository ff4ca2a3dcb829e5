"""The pictures: drawn without touching matplotlib's global backend, with the calibration's own tolerance."""

import matplotlib

from hf_earlyexit import plots
from hf_earlyexit.calibration import OperatingPoint


def test_the_tradeoff_plot_draws_the_calibrations_tolerance_and_leaves_the_backend_alone(tmp_path, monkeypatch):
    full = OperatingPoint({}, quality=0.8, expected_time_reduction=0.0)
    points = [OperatingPoint({"exit_threshold": t}, 0.8 - t / 10, t) for t in (0.1, 0.3)]
    drawn = []
    monkeypatch.setattr(plots, "save", lambda figure, path: drawn.append(figure) or path)
    original = matplotlib.get_backend()
    matplotlib.use("svg")  # a user's choice, e.g. a notebook's inline backend
    try:
        plots.tradeoff_plot({"vqa": (full, points)}, tmp_path / "a.png", tolerance=0.05)
        plots.tradeoff_plot({"vqa": (full, points)}, tmp_path / "b.png")  # a certified choice: no quality line
        backend = matplotlib.get_backend()
    finally:
        matplotlib.use(original)
    levels = [[tuple(line.get_ydata()) for line in figure.axes[0].get_lines() if line.get_label() == "tolerance"]
              for figure in drawn]  # fmt: skip
    assert levels == [[(95.0, 95.0)], []]  # was always 99%
    assert backend == "svg"  # pyplot's `use("Agg")` switched it


def test_pictures_are_written_as_image_files(tmp_path):
    path = plots.exit_picture([[("a", 1), ("circle", 3)]], decoder_layers=3, path=tmp_path / "exits.png")
    assert path.read_bytes().startswith(b"\x89PNG")
