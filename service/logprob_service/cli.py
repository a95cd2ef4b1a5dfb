"""``logprob-service serve`` (every setting is a flag, derived from config.Settings) and ``logprob-service probe``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import typing
from collections.abc import Sequence

from pydantic import ValidationError

from logprob_service import __version__
from logprob_service.config import ENV_ONLY_SETTINGS, Settings, load_settings
from logprob_service.logs import configure_logging

_MODEL_FLAG_HELP = (
    "NAME=SOURCE of a model to serve; repeat for several. A bare SOURCE is named 'default'. "
    "SOURCE: builtin:tiny-llama, a local HF checkpoint directory, or a hub id. "
    "[env LOGPROB_MODELS; default: default=builtin:tiny-llama]"
)


# The exit code of a server whose tensor-parallel group lost a rank (a restart serves again).
EXIT_GROUP_LOST = 3


def _flag_type(annotation: object) -> tuple[type, list[str] | None]:
    """argparse type and choices for a Settings field's annotation."""
    if typing.get_origin(annotation) is typing.Literal:
        return str, list(typing.get_args(annotation))
    return (annotation if annotation in (int, float, str) else str), None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="logprob-service", description="Token log-prob scoring service.")
    parser.add_argument("--version", action="version", version=f"logprob-service {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve models over gRPC",
        description="Serve models over gRPC. Precedence: flags > LOGPROB_* environment > --config file > defaults.",
        argument_default=argparse.SUPPRESS,  # only flags given on the command line override
        # No prefixes: `--auth-tokens SECRET` must not pass as `--auth-tokens-file` (and echo the secret).
        allow_abbrev=False,
    )
    serve.add_argument("--config", help="YAML file of settings (same names as the flags, with _) [env LOGPROB_CONFIG]")
    serve.add_argument("--model", dest="models", action="append", metavar="NAME=SOURCE", help=_MODEL_FLAG_HELP)
    for name, field in Settings.model_fields.items():
        if name == "models" or name in ENV_ONLY_SETTINGS:
            continue
        flag = "--" + name.replace("_", "-")
        help_text = (
            f"{field.description} [env LOGPROB_{name.upper()}; default: {field.get_default(call_default_factory=True)}]"
        ).replace("%", "%%")  # argparse formats help with %: a literal "0.3%" broke --help
        if field.annotation is bool:
            serve.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            kind, choices = _flag_type(field.annotation)
            serve.add_argument(flag, dest=name, type=kind, choices=choices, help=help_text)
    probe = commands.add_parser(
        "probe",
        help="exit 0 if a server is SERVING (gRPC health check), else 1",
        description="Ask a server's gRPC health service whether it is SERVING (the container's health check).",
    )
    probe.add_argument(
        "--address",
        help="HOST:PORT to ask [default: the host and port that `serve` would use in this environment, "
        "loopback for 0.0.0.0]",
    )
    probe.add_argument("--service", default="", help="service name to ask about [default: '', the whole server]")
    probe.add_argument("--timeout-s", type=float, default=5.0, help="seconds to wait for the answer [default: 5]")
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    return load_settings(getattr(args, "config", None) or os.environ.get("LOGPROB_CONFIG"), **overrides)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "probe":
            from logprob_service.api.probe import main as probe

            return probe(args.address, args.service, args.timeout_s)
        settings = settings_from_args(args)
    except (ValidationError, FileNotFoundError, ValueError) as err:
        print(f"logprob-service: invalid settings:\n{err}", file=sys.stderr)
        return 1 if args.command == "probe" else 2  # a health check knows 0 and 1 only
    configure_logging(settings.log_level, settings.log_format)
    from logprob_service.api.security.bearer_tokens import TokenConfigError
    from logprob_service.models.loading import ModelLoadError
    from logprob_service.startup import serve
    from logprob_service.worker.tensor_parallel import GroupLost

    try:
        asyncio.run(serve(settings))
    except GroupLost:
        # Logged; threads may wait forever in a collective with the lost rank, so none is joined.
        logging.shutdown()
        os._exit(EXIT_GROUP_LOST)
    except TokenConfigError as err:  # found before anything starts, like any other invalid setting
        print(f"logprob-service: invalid settings:\n{err}", file=sys.stderr)
        return 2
    except ModelLoadError as err:
        logging.getLogger("logprob_service").error("%s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
