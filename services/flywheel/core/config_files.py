"""Config files and secrets for settings: reading YAML/TOML/JSON files with one section per
service, masking credentials for display and logs, and naming invalid fields in messages.

Torch-free and dependency-light (PyYAML only when a YAML file is read).
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

SECRET_KEY = re.compile(r"(^|_)(api_key|password|secret|token)$")
"""Setting names whose values are credentials (masked by `mask_secrets`)."""
URL_PASSWORD = re.compile(r"^([a-z][a-z0-9+.-]*://[^/@:]*:)([^/@]+)(@)", re.IGNORECASE)
MASK = "***"


def mask_secrets(data: Any, key: str = "") -> Any:
    """A copy of settings data (`model_dump(mode="json")`) with credentials replaced by `***`:
    values of keys named like api_key/password/secret/token, and passwords inside URLs
    (`redis://:pw@host` -> `redis://:***@host`). Empty and null values stay as they are."""
    if isinstance(data, dict):
        return {k: mask_secrets(v, str(k)) for k, v in data.items()}
    if isinstance(data, list):
        return [mask_secrets(v, key) for v in data]
    if isinstance(data, str):
        if data and SECRET_KEY.search(key):
            return MASK
        return URL_PASSWORD.sub(rf"\g<1>{MASK}\g<3>", data)
    return data


class ConfigFileError(ValueError):
    """A config file that cannot be read as settings (syntax, or not a mapping of sections)."""


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The sections of a YAML (`.yaml`/`.yml`), JSON (`.json`) or TOML (other) config file.

    Raises:
        FileNotFoundError: the file does not exist.
        ConfigFileError: a syntax error (with its line), or a top level that is not a mapping.
    """
    path = Path(path)
    text = path.read_text()
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            import yaml  # noqa: PLC0415

            data = yaml.safe_load(text)
            data = {} if data is None else data
        elif suffix == ".json":
            data = json.loads(text)
        else:
            data = tomllib.loads(text)
    except Exception as exc:  # yaml.YAMLError, JSONDecodeError, TOMLDecodeError
        raise ConfigFileError(f"{path}: not valid {suffix.lstrip('.') or 'TOML'}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: the top level must be a mapping with one section per "
                              f"service (engine, gateway, reward, teacher, trainer, ...), not a "
                              f"{type(data).__name__}")
    return data


def describe_validation_error(exc: Any) -> str:
    """One line per invalid setting, named by its dotted path and its environment variable:
    `trainer.lr (FLYWHEEL_TRAINER__LR): Input should be greater than 0 (got -1)`."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        env = "FLYWHEEL_" + "__".join(str(p) for p in err["loc"]).upper()
        got = f" (got {err['input']!r})" if err["type"] != "extra_forbidden" and not isinstance(
            err.get("input"), dict) else ""
        if SECRET_KEY.search(str(err["loc"][-1]) if err["loc"] else ""):
            got = ""
        lines.append(f"  {loc} ({env}): {err['msg']}{got}")
    return "\n".join(lines)
