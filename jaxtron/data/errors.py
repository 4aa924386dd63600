"""The data error type (defined apart so every data module can raise it without import cycles)."""

from jaxtron.config.schema import ConfigError


class DataError(ConfigError):
    """Bad data input (files, tokenizers, stores); one sentence naming the file and the fix, exit 2."""
