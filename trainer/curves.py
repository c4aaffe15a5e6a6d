"""Training curves of a run: each outer step's item-update losses and epsilon, as JSON and TensorBoard.

Every item update writes `RUN/step-s/curves.json` (its epoch losses, the epsilon the ledger has
spent after the step, its seconds) and TensorBoard event files under `RUN/tensorboard/step-s/`
(`item_update/loss` by epoch: the SSP objective, negative by design, as its description in
TensorBoard says); evaluation gathers the steps into `metrics.json`'s `curves` and
writes `RUN/tensorboard/run/` (`epsilon_spent` and the last item-update loss by outer step, and the
final metrics). `tensorboard --logdir RUN/tensorboard` shows them. The events are written into a
local folder that `schemas.storage` commits (atomically, local or gs://), like the checkpoints.

Privacy: the SSP losses are computed from released statistics (post-processing, public). DP-SGD's
and the closed-form updates' curves hold no loss: a loss over private rows is not a release.
"""

from __future__ import annotations

import tensorflow as tf

from schemas import storage

CURVES = "curves.json"
# the SSP objective is the squared error less its constant part (sum of w y^2 / 2, never released): below zero by design
LOSS_DESCRIPTION = (
    "The SSP objective 1/2 v'A v - b'v (+ penalties) over the released statistics: the weighted squared error "
    "less its constant part, sum w y^2 / 2, which is not released. Negative values are expected; lower is better."
)


def write_step(step_folder: str, events_folder: str, losses: list[float], epsilon_spent: float, seconds: float) -> dict:
    """Record outer step's curve at `step_folder/curves.json` and its events in `events_folder`."""
    curve = {
        "item_update_loss": [float(loss) for loss in losses],
        "epsilon_spent": float(epsilon_spent),
        "seconds": float(seconds),
    }
    with storage.write_folder(events_folder) as local:
        with tf.summary.create_file_writer(local).as_default():
            for epoch, loss in enumerate(losses, start=1):
                tf.summary.scalar("item_update/loss", loss, step=epoch, description=LOSS_DESCRIPTION)
    storage.write_json(curve, storage.join(step_folder, CURVES))
    return curve


def gather(step_folders: list[str], events_folder: str, final: dict[str, float]) -> dict:
    """The steps' curves ({"item_update_loss": {s: [...]}, "epsilon_spent": {s: eps}}) for
    metrics.json, also written as TensorBoard events by outer step (and the `final` metrics at the
    last step) in `events_folder`. A step done before curves were recorded is left out."""
    curves = {"item_update_loss": {}, "epsilon_spent": {}}
    for step, folder in enumerate(step_folders, start=1):
        path = storage.join(folder, CURVES)
        if storage.exists(path):
            curve = storage.read_json(path)
            curves["item_update_loss"][str(step)] = curve["item_update_loss"]
            curves["epsilon_spent"][str(step)] = float(curve["epsilon_spent"])  # JSON holds infinity as "inf"
    with storage.write_folder(events_folder) as local:
        with tf.summary.create_file_writer(local).as_default():
            for step, epsilon in curves["epsilon_spent"].items():
                tf.summary.scalar("epsilon_spent", epsilon, step=int(step))
                losses = curves["item_update_loss"][step]
                if losses:
                    tf.summary.scalar("item_update/last_loss", losses[-1], step=int(step), description=LOSS_DESCRIPTION)
            for name, value in final.items():
                tf.summary.scalar(f"final/{name}", value, step=len(step_folders))
    return curves
