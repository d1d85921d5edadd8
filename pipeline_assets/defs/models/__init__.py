"""Models: the ``model_switch`` sensor and the ``model`` partition keys it keeps in step."""

import dagster as dg

from pipeline_assets.defs.models.sensors import model_switch_sensor
from pipeline_assets.settings import Settings


def definitions(settings: Settings) -> dg.Definitions:
    """The domain (nothing in it depends on ``settings``)."""
    return dg.Definitions(sensors=[model_switch_sensor])
