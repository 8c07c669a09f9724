"""Errors that users of dsde_core see. Each names the problem and, where there is one, the fix."""


class DSDEError(Exception):
    """Base class of every error dsde_core raises on purpose."""


class ConfigError(DSDEError, ValueError):
    """A configuration or request parameter is out of range."""


class ModelLoadError(DSDEError):
    """A model could not be loaded."""


class MissingPartError(ModelLoadError):
    """A part package of an embedded model is not installed."""


class HashMismatchError(ModelLoadError):
    """The joined file of an embedded model does not have the expected sha256."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model's architecture is not one the runner implements."""


class VocabularyMismatchError(ModelLoadError):
    """Draft and target do not share a vocabulary."""
