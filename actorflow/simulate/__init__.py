"""``actorflow simulate``: a config's run predicted on the virtual clock with a cost model
fitted from a measured run (``costs``, ``predict``), and the search for the fastest
layouts (``layouts``)."""

from .costs import CalibrationError, CostModel, Link
from .predict import Prediction, calibrate, cost_model, fit_crowding, predict

__all__ = [
    "CalibrationError",
    "CostModel",
    "Link",
    "Prediction",
    "calibrate",
    "cost_model",
    "fit_crowding",
    "predict",
]
