"""Config files and secrets for settings: reading YAML/TOML/JSON files with one section per
service, masking credentials for display and logs, and naming invalid fields in messages.

Torch-free and dependency-light (PyYAML only when a YAML file is read).
"""

from __future__ import annotations

import json
import os
import re
import tomllib
import typing
from collections.abc import Mapping
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
        ConfigFileError: a directory, an unreadable or non-UTF-8 file, a syntax error (with its
            line), or a top level that is not a mapping.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise
    except IsADirectoryError:
        raise ConfigFileError(
            f"{path}: is a directory, not a config file; pass a TOML, YAML or JSON file"
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigFileError(
            f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); save "
            "it as UTF-8 TOML, YAML or JSON"
        ) from None
    except OSError as exc:
        raise ConfigFileError(
            f"{path}: cannot be read ({exc.strerror or exc}); pass a "
            "readable TOML, YAML or JSON file"
        ) from None
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
        raise ConfigFileError(
            f"{path}: the top level must be a mapping with one section per "
            f"service (engine, gateway, reward, teacher, trainer, ...), not a "
            f"{type(data).__name__}"
        )
    return data


def describe_validation_error(
    exc: Any,
    model: Any = None,
    path: str | os.PathLike[str] | None = None,
    file_data: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> str:
    """One line per invalid setting, named by its dotted path and where its value came from:
    the `FLYWHEEL_...` variable when the environment set it (for an error of a whole section,
    raised by its own check, the variables set inside it: `trainer in FLYWHEEL_TRAINER__LR`),
    else the config file when the file set it (`trainer.optim.lr in a.toml: Input should be
    greater than 0 (got -1)`), else (an override, or no file given) the variable that would
    set it. An unknown key is named
    with the closest known settings of its section (`unknown setting gateway.prot in a.toml;
    did you mean gateway.port?`), or with all of them when none is close.

    Args:
        exc: the `pydantic.ValidationError` of the settings.
        model: the settings class (`FlywheelSettings`), for the known keys; None = no
            suggestions.
        path: the config file read, and `file_data` its sections (`read_config_file`).
        environ: the environment (default `os.environ`).
    """
    environ = os.environ if environ is None else environ
    env_names = {name.upper(): name for name in environ}
    lines = []
    for err in exc.errors():
        parts = [str(p) for p in err["loc"]]
        msg = str(err["msg"]).removeprefix("Value error, ")  # a check's own ValueError
        if not parts:
            lines.append(f"  {msg}")
            continue
        loc = ".".join(parts)
        env = _env_name(parts)
        source_var = next(
            (
                env_names[_env_name(parts[:n])]
                for n in range(len(parts), 0, -1)
                if _env_name(parts[:n]) in env_names
            ),
            None,
        )
        under = _env_set_under(parts, env_names)
        unknown = _unknown_env(model, under)
        if source_var is not None:
            where = f"in {source_var}"
        elif unknown or (under and not (path is not None and _in_data(file_data, parts))):
            where = f"in {', '.join(unknown or under)}"
        elif path is not None and _in_data(file_data, parts):
            where = f"in {path}"
        else:
            where = f"({env})"
        if err["type"] == "extra_forbidden":
            hint = _known_keys_hint(model, parts, with_env=source_var == env)
            lines.append(f"  unknown setting {loc} {where}{hint}")
            continue
        got = "" if isinstance(err.get("input"), dict) else f" (got {err['input']!r})"
        if SECRET_KEY.search(parts[-1]):
            got = ""
        lines.append(f"  {loc} {where}: {msg}{got}")
    return "\n".join(lines)


def _env_set_under(parts: list[str], env_names: Mapping[str, str]) -> list[str]:
    """The variables set (as spelled in the environment) for settings inside the section at
    `parts`: `FLYWHEEL_TRAINER__LR` and `FLYWHEEL_TRAINER__OPTIM__LR` under `trainer`."""
    head = _env_name(parts) + "__"
    return [env_names[upper] for upper in sorted(env_names) if upper.startswith(head)]


def _unknown_env(model: Any, names: list[str]) -> list[str]:
    """Those of the `FLYWHEEL_...` variables `names` that name no setting of `model` (none
    when `model` is None): what a section's own check refuses (`trainer.lr moved to ...`), so
    an error of the whole section names them rather than its other variables."""
    if model is None:
        return []
    return [
        name
        for name in names
        if _annotation_at(model, name[len("FLYWHEEL_") :].lower().split("__")) is _NOWHERE
    ]


def _env_name(parts: list[str]) -> str:
    return "FLYWHEEL_" + "__".join(parts).upper()


def _in_data(data: Mapping[str, Any] | None, parts: list[str]) -> bool:
    """Whether the nested mapping `data` has a value at `parts`."""
    node: Any = data
    for part in parts:
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


_NOWHERE = object()
"""`_annotation_at` of a path that names no setting."""


def _settings_class(annotation: Any) -> Any:
    """The settings class `annotation` is or holds (`Section`, `Section | None`), else None."""
    return next(
        (a for a in (annotation, *typing.get_args(annotation)) if hasattr(a, "model_fields")),
        None,
    )


def _annotation_at(model: Any, parts: list[str]) -> Any:
    """The type annotation of the setting at `parts` under `model` (a settings class; `model`
    itself for no parts), through the sections on the way; `_NOWHERE` when no setting is there
    (a list item, a key of a dict setting, an unknown name)."""
    annotation: Any = model
    for part in parts:
        fields = getattr(_settings_class(annotation), "model_fields", None)
        if not isinstance(fields, dict) or part not in fields:
            return _NOWHERE
        annotation = fields[part].annotation
    return annotation


def _section_fields(model: Any, parts: list[str]) -> list[str] | None:
    """The setting names of the section at `parts` under `model` (a settings class); None when
    `parts` is no section (a list item, a dict setting, an unknown name)."""
    fields = getattr(_settings_class(_annotation_at(model, parts)), "model_fields", None)
    return sorted(fields) if isinstance(fields, dict) else None


def _known_keys_hint(model: Any, parts: list[str], with_env: bool) -> str:
    """`; did you mean gateway.port?` (the closest known names, by `difflib`), else `; the
    settings of gateway are: ...`; "" when the section is not known."""
    import difflib  # noqa: PLC0415

    names = _section_fields(model, parts[:-1]) if model is not None else None
    if not names:
        return ""
    head = parts[:-1]
    close = difflib.get_close_matches(parts[-1], names, n=3, cutoff=0.6)
    if close:
        guesses = [
            ".".join([*head, name]) + (f" ({_env_name([*head, name])})" if with_env else "")
            for name in close
        ]
        return f"; did you mean {' or '.join(guesses)}?"
    section = ".".join(head) or "the top level"
    return f"; the settings of {section} are: {', '.join(names)}"


def describe_settings_error(
    exc: Any, model: Any, config_file: str | os.PathLike[str] | None = None
) -> str:
    """`describe_validation_error` for settings loaded from `config_file` (None =
    `$FLYWHEEL_CONFIG`) and the environment, as `load_settings` reads them."""
    path = config_file or os.environ.get("FLYWHEEL_CONFIG") or None
    data: dict[str, Any] | None = None
    if path:
        try:
            data = read_config_file(path)
        except (OSError, ConfigFileError):
            data = None
    return describe_validation_error(exc, model, path, data)


def describe_env_parse_error(
    model: Any,
    environ: Mapping[str, str] | None = None,
    prefix: str = "FLYWHEEL_",
    delimiter: str = "__",
) -> str:
    """Why pydantic-settings could not parse the environment (its `SettingsError` names only
    the section): one line per `FLYWHEEL_<SECTION>__<FIELD>` variable of a list, dict or
    section setting whose value is not JSON, saying the format expected.

    Args:
        model: the settings class (`FlywheelSettings`); its fields give each variable's type.
        environ: the environment (default `os.environ`).
    """
    environ = os.environ if environ is None else environ
    lines = []
    for name, value in sorted(environ.items()):
        if not name.upper().startswith(prefix):
            continue
        kind = _complex_kind(model, name[len(prefix) :].lower().split(delimiter))
        if kind is None:
            continue
        try:
            json.loads(value)
        except ValueError:
            example = {"list": '\'["a", "b"]\'', "dict": "'{\"key\": 1.0}'"}.get(
                kind, '\'{"field": "value"}\''
            )
            lines.append(
                f"  {name}={value!r}: a {kind} setting takes a JSON value, e.g. {name}={example}"
            )
    return "\n".join(lines)


def _complex_kind(model: Any, parts: list[str]) -> str | None:
    """ "list", "dict" or "section" when the field at `parts` under `model` is read from the
    environment as JSON; None for a plain value or an unknown name."""
    annotation = _annotation_at(model, parts)
    if annotation is _NOWHERE:
        return None
    for arg in (annotation, *typing.get_args(annotation)):  # Optional[...] and unions too
        origin = typing.get_origin(arg) or arg
        if origin in (list, tuple, set, frozenset):
            return "list"
        if origin is dict:
            return "dict"
        if hasattr(arg, "model_fields"):
            return "section"
    return None


def known_sections(model: Any) -> list[str]:
    """The names of `model`'s settings sections (its fields that are settings classes)."""
    fields = getattr(model, "model_fields", {})
    return sorted(name for name, f in fields.items() if hasattr(f.annotation, "model_fields"))


def unknown_file_sections(model: Any, data: Mapping[str, Any], path: str) -> str:
    """Why a config file's top-level key would be refused, naming what it may be: "" when every
    key is a setting of `model` (a section such as `gateway`, or a top-level one such as
    `state_dir`), else one message listing the unknown keys, the known sections and the
    top-level settings.

    Example: `[gatway]` -> "config file f.toml: no settings section 'gatway'; known sections:
    engine, fleet, gateway, ...; top-level settings: log_level, state_dir"."""
    fields = getattr(model, "model_fields", {})
    unknown = [repr(key) for key in data if key not in fields]
    if not unknown:
        return ""
    sections = known_sections(model)
    top = sorted(name for name in fields if name not in sections)
    return (
        f"config file {path}: no settings section {', '.join(unknown)}; known sections: "
        f"{', '.join(sections)}; top-level settings: {', '.join(top)}"
    )


def unknown_env_sections(
    model: Any,
    environ: Mapping[str, str] | None = None,
    prefix: str = "FLYWHEEL_",
    delimiter: str = "__",
) -> str:
    """Why a `FLYWHEEL_<SECTION>__<FIELD>` variable would be ignored: one line per variable
    whose SECTION is not a section of `model` (pydantic-settings reads only the names of known
    fields, so `FLYWHEEL_GATWAY__PORT` would otherwise change nothing without a word). Only
    names with the nested delimiter after the prefix are settings; other `FLYWHEEL_*`
    variables (`FLYWHEEL_CONFIG`, `FLYWHEEL_STATEDIR`, ...) are `unknown_env_variables`'.

    Args:
        model: the settings class (`FlywheelSettings`); its section fields are the known names.
        environ: the environment (default `os.environ`).

    Returns:
        "" when every such variable names a known section, else the lines to show.
    """
    environ = os.environ if environ is None else environ
    sections = known_sections(model)
    lines = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(prefix) or delimiter not in upper[len(prefix) :]:
            continue
        section = upper[len(prefix) :].split(delimiter, 1)[0].lower()
        if section in sections:
            continue
        lines.append(
            f"  {name}: no settings section {section!r}; known sections: " + ", ".join(sections)
        )
    return "\n".join(lines)


COMPOSE_VARIABLES = frozenset(
    {"FLYWHEEL_TEACHER_ENABLED", "FLYWHEEL_TEACHER_ENGINE_URLS", "FLYWHEEL_TEACHER_MODEL"}
)
"""Variables docker-compose.yml reads itself (and passes on as `FLYWHEEL_TEACHER__ENABLED`,
...): a shell may export them for `docker compose up`, so they are not taken for misspelled
settings."""


READ_VARIABLES = COMPOSE_VARIABLES | {
    "FLYWHEEL_API_KEY",  # flywheel demo --api-key
    "FLYWHEEL_CACHE",  # converted models (core.paths)
    "FLYWHEEL_CONFIG",  # the config file
    "FLYWHEEL_CONTAINER_TESTS",  # make compose-test
    "FLYWHEEL_DASHBOARD_PNG",  # the dashboard test's screenshot
    "FLYWHEEL_INSTANCE",  # the stack's nonce, set for its children
    "FLYWHEEL_LOG_JSON",  # JSON log lines
    "FLYWHEEL_MODEL",  # docker-compose.yml
    "FLYWHEEL_PEERS_DIR",  # bench/peers
    "FLYWHEEL_STREAM_PREFIX",  # docker-compose.yml
    "FLYWHEEL_TAG",  # docker-compose.yml and the image build
}
"""`FLYWHEEL_*` variables that are no setting but are read as they are (by flywheel, the
compose file, the benchmarks or the tests): never taken for misspelled settings."""


def setting_variables(model: Any, prefix: str = "FLYWHEEL_", delimiter: str = "__") -> list[str]:
    """Every variable that sets a setting of `model`: `FLYWHEEL_STATE_DIR`, `FLYWHEEL_GATEWAY`
    (a whole section as JSON), `FLYWHEEL_GATEWAY__PORT`, `FLYWHEEL_TRAINER__OPTIM__LR`, ..."""
    names: list[str] = []

    def walk(annotation: Any, head: list[str]) -> None:
        fields = getattr(_settings_class(annotation), "model_fields", None)
        if not isinstance(fields, dict):
            return
        for name, field in fields.items():
            names.append(prefix + delimiter.join([*head, name]).upper())
            walk(field.annotation, [*head, name])

    walk(model, [])
    return sorted(names)


def unknown_env_variables(
    model: Any,
    environ: Mapping[str, str] | None = None,
    prefix: str = "FLYWHEEL_",
    delimiter: str = "__",
    read: frozenset[str] | set[str] = READ_VARIABLES,
) -> str:
    """Why a `FLYWHEEL_*` variable without the nested delimiter would be ignored: one line per
    variable that is neither a top-level setting of `model` (`FLYWHEEL_STATE_DIR`, or a section
    as JSON: `FLYWHEEL_GATEWAY`) nor one of `read`, naming the closest variable that is (by
    `difflib`), else the top-level settings and `read`. `FLYWHEEL_<SECTION>__...` names are
    left to `unknown_env_sections` and the settings' own check.

    Example: FLYWHEEL_STATEDIR -> "  FLYWHEEL_STATEDIR: not read (no setting has this name);
    did you mean FLYWHEEL_STATE_DIR?".

    Returns:
        "" when there is none, else the lines to show.
    """
    import difflib  # noqa: PLC0415

    environ = os.environ if environ is None else environ
    fields = getattr(model, "model_fields", {})
    lines = []
    candidates: dict[str, str] | None = None
    for name in sorted(environ):
        upper = name.upper()
        rest = upper[len(prefix) :]
        if not upper.startswith(prefix) or name in read or delimiter in rest:
            continue
        if rest.lower() in fields:
            continue
        if candidates is None:
            known = [*setting_variables(model, prefix, delimiter), *sorted(read)]
            candidates = {variable[len(prefix) :]: variable for variable in known}
        close = (
            [rest]  # the right name in the wrong case
            if rest in candidates
            else difflib.get_close_matches(rest, list(candidates), n=3, cutoff=0.6)
        )
        if close:
            hint = f"did you mean {' or '.join(candidates[c] for c in close)}?"
        else:
            top = sorted(prefix + field.upper() for field in fields)
            hint = (
                f"settings are {prefix}<SECTION>{delimiter}<FIELD> or one of "
                f"{', '.join(top)}; other variables read: {', '.join(sorted(read))}"
            )
        lines.append(f"  {name}: not read (no setting has this name); {hint}")
    return "\n".join(lines)


def single_underscore_settings(
    model: Any, environ: Mapping[str, str] | None = None, prefix: str = "FLYWHEEL_"
) -> str:
    """Why a `FLYWHEEL_<SECTION>_<FIELD>` variable (one underscore after the section) would be
    ignored: pydantic-settings reads only `FLYWHEEL_<SECTION>__<FIELD>`, so
    `FLYWHEEL_GATEWAY_PORT=9000` would change nothing without a word. One line per variable
    whose name is a known section, one underscore and a field of that section (the start of a
    nested one too: `FLYWHEEL_TRAINER_OPTIM__LR`), naming the spelling that works; other
    `FLYWHEEL_*` names (`FLYWHEEL_CONFIG`, `FLYWHEEL_STATE_DIR`, `COMPOSE_VARIABLES`) are not
    looked at.

    Example: FLYWHEEL_GATEWAY_PORT -> "  FLYWHEEL_GATEWAY_PORT: not read; the setting
    gateway.port is FLYWHEEL_GATEWAY__PORT (two underscores after the section)".

    Returns:
        "" when there is none, else the lines to show.
    """
    environ = os.environ if environ is None else environ
    fields = getattr(model, "model_fields", {})
    lines = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(prefix) or upper in COMPOSE_VARIABLES:
            continue
        rest = upper[len(prefix) :]
        for section in known_sections(model):
            head = f"{section.upper()}_"
            if not rest.startswith(head) or rest.startswith(f"{head}_"):
                continue
            field = rest[len(head) :].split("__", 1)[0].lower()
            if field in getattr(fields[section].annotation, "model_fields", {}):
                fixed = f"{prefix}{section.upper()}__{rest[len(head) :]}"
                lines.append(
                    f"  {name}: not read; the setting {section}.{field} is {fixed} (two "
                    "underscores after the section)"
                )
    return "\n".join(lines)
