"""User-facing errors: one line naming the field (or file) and the fix."""


class DFlashError(Exception):
    """An error the user can act on; the CLI prints it without a traceback."""


class ConfigError(DFlashError, ValueError):
    """A config field has a bad value. The message names the field and the fix."""


class CheckpointError(DFlashError):
    """A checkpoint folder is missing, incomplete or corrupt."""


class IncompatibleModelsError(DFlashError):
    """Drafter and target do not fit together (hidden size, vocab, tapped layers)."""
