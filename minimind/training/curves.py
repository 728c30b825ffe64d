"""A run's loss curves from Trainer's log history: loss_curve.md (a table) and loss_curve.png (a plot, which the
model card that minimind-push writes shows)."""

from __future__ import annotations

from pathlib import Path

LOSS_TABLE, LOSS_PLOT = "loss_curve.md", "loss_curve.png"


def loss_curve(log_history, key="loss"):
    """[(step, loss)] from Trainer's log history: the training loss, or with key="eval_loss" the eval loss."""
    return [(entry["step"], entry[key]) for entry in log_history if key in entry and "step" in entry]


def write_loss_curve(log_history, output_dir):
    """Write loss_curve.md (step | training loss | eval loss) and loss_curve.png (both losses against steps).
    Returns the paths written; none for a run that logged no loss."""
    train, evaluation = loss_curve(log_history), loss_curve(log_history, "eval_loss")
    if not train and not evaluation:
        return []
    by_step = {step: [f"{loss:.4f}", ""] for step, loss in train}
    for step, loss in evaluation:
        by_step.setdefault(step, ["", ""])[1] = f"{loss:.4f}"
    table = Path(output_dir) / LOSS_TABLE
    rows = "".join(
        f"| {step} | {train_loss} | {eval_loss} |\n" for step, (train_loss, eval_loss) in sorted(by_step.items())
    )
    table.write_text("| step | training loss | eval loss |\n|---:|---:|---:|\n" + rows, encoding="utf-8")

    from matplotlib.figure import Figure  # pyplot's global state is not needed to write one file

    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    for curve, label, style in ((train, "training loss", "-"), (evaluation, "eval loss", "o--")):
        if curve:
            axes.plot(*zip(*curve), style, label=label)
    axes.set(xlabel="step", ylabel="loss", title="MiniMind loss")
    axes.legend()
    plot = Path(output_dir) / LOSS_PLOT
    figure.savefig(plot, dpi=100, bbox_inches="tight")
    return [table, plot]
