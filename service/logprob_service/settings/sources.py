"""Where the server's settings come from, and how a problem with one is told: the ``LOGPROB_*``
variables (an unknown one is refused), the YAML config file, the flags; a ``StartupError``'s lines
name the setting as the user wrote it (``Origins``); list settings as the environment and flags
spell them (``split_list``); the ``NAME=SOURCE`` model specs and the check that their paths exist.

``model.Settings`` is the one settings model and ``model.load_settings`` reads it with this.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic_core import ErrorDetails

from logprob_service.settings.errors import StartupError

# Settings that hold secrets: read from the environment (or the config file), never from a flag,
# which would show in `ps`, shell history and process listings.
ENV_ONLY_SETTINGS = frozenset({"auth_tokens"})
ENV_PREFIX = "LOGPROB_"
CONFIG_ENV = "LOGPROB_CONFIG"
# LOGPROB_* variables that are not settings, so not refused as typos: the config file's; the host
# directory of checkpoints that deploy/compose.yaml mounts; the test suite's (the servers it
# starts inherit them).
OTHER_ENV_VARIABLES = frozenset(
    {
        CONFIG_ENV,
        "LOGPROB_MODELS_DIR",
        "LOGPROB_TEST_SEED",
        "LOGPROB_TEST_SEEDS",
        "LOGPROB_LOAD_FULL",
        "LOGPROB_KEEP_IMAGE",
        "LOGPROB_SOAK_ONLY",
    }
)
# BASE+ADAPTER_DIR: a LoRA model sharing the weights of the served model BASE.
LORA_SEPARATOR = "+"
_MODEL_SPEC_FORM = "NAME=SOURCE, e.g. ref=/models/Qwen2.5-7B-Instruct or ref=builtin:tiny-llama"


def flag(name: str) -> str:
    """The command-line flag of setting ``name``."""
    return "--model" if name == "models" else "--" + name.replace("_", "-")


def env_variable(name: str) -> str:
    """The environment variable of setting ``name``."""
    return ENV_PREFIX + name.upper()


def split_list(value: Any) -> Any:
    """A list setting as a flag or variable spells it, a comma-separated string (or a JSON list),
    as its items; anything else (the config file's YAML list) unchanged, for the field's type to check."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


def parse_model_specs(value: Any) -> dict[str, str]:
    """Models as NAME=SOURCE specs: a mapping, a list of specs, JSON, or a comma-separated string.

    A spec without ``NAME=`` is refused: a bare word is as likely a name missing its source as a
    hub id, and taken as a hub id it cost a minute of download retries offline.
    """
    if isinstance(value, dict):
        value = [f"{k}={'' if v is None else v}" for k, v in value.items()]
    elif isinstance(value, str):
        if value.strip().startswith("{"):
            return parse_model_specs(json.loads(value))
        value = split_list(value)
    models: dict[str, str] = {}
    for spec in value:
        name, sep, source = str(spec).strip().partition("=")
        name, source = name.strip(), source.strip()
        if not (sep and name and source):
            raise ValueError(f"{str(spec).strip()!r} is not {_MODEL_SPEC_FORM}")
        if name in models:
            raise ValueError(f"model name {name!r} is declared twice")
        models[name] = source
    return models


def split_lora_source(source: str, served: Collection[str]) -> tuple[str, str] | None:
    """``(base, adapter_dir)`` when ``source`` is ``BASE+ADAPTER_DIR`` with BASE one of ``served``."""
    base, sep, adapter = source.partition(LORA_SEPARATOR)
    if sep and base in served and adapter:
        return base, adapter
    return None


def _looks_like_path(source: str) -> bool:
    """A local path rather than a hub id (``name`` or ``namespace/name``): absolute, relative to
    ``.``, ``..`` or ``~``, or more than one ``/`` deep."""
    return source in (".", "..") or source.startswith(("/", "./", "../", "~")) or source.count("/") > 1


def model_source_problems(models: Mapping[str, str]) -> list[str]:
    """What of ``models`` cannot be served, found without loading anything: a local checkpoint
    or LoRA adapter directory that does not exist. (A hub id is looked up when it is loaded.)"""
    problems = []
    for name, source in models.items():
        lora = split_lora_source(source, set(models) - {name})
        path, what = (lora[1], "LoRA adapter directory ") if lora is not None else (source, "")
        if (lora is not None or _looks_like_path(path)) and not Path(path).expanduser().exists():
            problems.append(f"model {name!r}: {what}{path} not found")
    return problems


def _closest(word: str, choices: Collection[str]) -> str | None:
    match = difflib.get_close_matches(word, choices, n=1)
    return match[0] if match else None


def _truncated(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 200 else text[:197] + "..."  # a path in full; not a whole document


class Origins:
    """Where each setting's value came from (a flag, a ``LOGPROB_*`` variable, the config file or
    the default), to name it in an error as the user wrote it. ``settings``: the names of the
    settings model's fields (passed in: the model, in ``model``, is built on this module)."""

    def __init__(self, settings: Collection[str], flags: Mapping[str, Any], config_file: Path | str | None) -> None:
        self.settings = settings
        # A setting's name in an error message, to be replaced by its flag (names of one word are
        # left alone: "port" is also a word of the messages).
        self.setting_names = re.compile(r"\b(" + "|".join(n for n in settings if "_" in n) + r")\b")
        self.flags = flags
        self.environ = {k.upper(): (k, v) for k, v in os.environ.items() if k.upper().startswith(ENV_PREFIX)}
        self.file, self.file_values = None, {}
        if config_file or self.environ.get(CONFIG_ENV, ("", ""))[1]:  # an empty LOGPROB_CONFIG names none
            self.file, self.file_values = _read_config_file(config_file, self.environ)

    def where(self, name: str, *, with_value: bool = True, with_flag: bool = True) -> str:
        """``--max-batch-tokens 0``, ``LOGPROB_MAX_BATCH_TOKENS=0 (--max-batch-tokens)``,
        ``max_batch_tokens: 0 in FILE (--max-batch-tokens)``, or the flag alone for a default."""
        if name in self.flags:
            spelled, value, sep, after = flag(name), self.flags[name], " ", ""
        elif (variable := env_variable(name)) in self.environ:
            (spelled, value), sep, after = self.environ[variable], "=", ""
        elif name in self.file_values:
            spelled, value, sep, after = f"{name}:", self.file_values[name], " ", f" in {self.file}"
        else:
            return flag(name)
        # No secret is echoed; a list or mapping (--model's) is shown by the message, spec by spec.
        if with_value and name not in ENV_ONLY_SETTINGS and not isinstance(value, list | dict):
            spelled += sep + _truncated(value)
        return spelled + after + (f" ({flag(name)})" if with_flag and name not in self.flags else "")

    def problem(self, error: ErrorDetails) -> str:
        """One line for one of pydantic's errors."""
        message = self.setting_names.sub(lambda m: flag(m[1]), error["msg"].removeprefix("Value error, "))
        if not error["loc"]:  # a check of several settings together: where those not from flags came from
            named = {m[1] for m in self.setting_names.finditer(error["msg"])}
            elsewhere = sorted(self.where(n, with_flag=False) for n in named if n not in self.flags)
            elsewhere = [w for w in elsewhere if not w.startswith("--")]  # not defaults
            return message + (f" (from {', '.join(elsewhere)})" if elsewhere else "")
        name = str(error["loc"][0])
        if name not in self.settings:  # extra="forbid": a key of the file (or an override) no setting has
            where = f" in {self.file}" if name in self.file_values else ""
            guess = _closest(name, self.settings)
            return f"{name}{where} is not a setting" + (f"; did you mean {guess} ({flag(guess)})?" if guess else "")
        return f"{self.where(name)}: {message}"

    def unknown_variables(self) -> list[str]:
        """A LOGPROB_* variable that names no setting is a typo, refused as the file's unknown keys
        are: ignored, it left the setting at its default without a word."""
        settings = {name.upper(): name for name in self.settings}
        problems = []
        for variable, (spelled, _) in sorted(self.environ.items()):
            if variable[len(ENV_PREFIX) :] not in settings and variable not in OTHER_ENV_VARIABLES:
                guess = _closest(variable[len(ENV_PREFIX) :], settings)  # the prefix alone is alike in all
                hint = (
                    f"did you mean {env_variable(settings[guess])} ({flag(settings[guess])})?"
                    if guess
                    else "logprob-service serve --help lists the settings"
                )
                problems.append(f"{spelled} is not a setting; {hint}")
        return problems


def _read_config_file(
    config_file: Path | str | None, environ: Mapping[str, tuple[str, str]]
) -> tuple[Path, dict[str, Any]]:
    """The config file's path and settings; StartupError naming the file (and the line and column
    of a YAML syntax error)."""
    named_by = "--config" if config_file else environ[CONFIG_ENV][0]
    path = Path(config_file or environ[CONFIG_ENV][1])
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise StartupError(f"config file {path} ({named_by}): {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise StartupError(f"config file {path} ({named_by}): not UTF-8 text (byte {err.start})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(err, "problem", None) or str(err)
        raise StartupError(f"config file {path}{at} ({named_by}): not valid YAML: {what}") from None
    if values is None:  # an empty file
        return path, {}
    if not isinstance(values, dict):
        raise StartupError(f"config file {path} ({named_by}): expected settings (name: value), found {values!r:.60}")
    return path, {str(key): value for key, value in values.items()}
