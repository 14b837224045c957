"""The repository layer's one error type: a config problem located by file, model and field."""
from __future__ import annotations

from pathlib import Path


class ConfigError(Exception):
    """A model configuration problem.

    ``str(err)`` names the file, the model and the field, e.g.
    ``models/mlp/config.pbtxt: model 'mlp': field 'input[0].data_type': missing``.
    Parts that are unknown (empty strings) are left out of the message.
    """

    def __init__(self, file: str | Path, model: str, field: str, message: str) -> None:
        self.file = str(file) if str(file) != "." else ""
        self.model = model
        self.field = field
        self.message = message
        super().__init__(self._render())

    def _render(self) -> str:
        parts: list[str] = []
        if self.file:
            parts.append(self.file)
        if self.model:
            parts.append(f"model '{self.model}'")
        if self.field:
            parts.append(f"field '{self.field}'")
        parts.append(self.message)
        return ": ".join(parts)

    def __str__(self) -> str:
        return self._render()

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str, str, str]]:
        return (type(self), (self.file, self.model, self.field, self.message))

    def located(self, file: str | Path, model: str) -> ConfigError:
        """A copy with ``file`` and ``model`` filled in where this error left them empty."""
        return ConfigError(self.file or file, self.model or model, self.field, self.message)
