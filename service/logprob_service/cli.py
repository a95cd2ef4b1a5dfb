"""``logprob-service serve`` (every setting is a flag, derived from the settings model) and ``logprob-service probe``.

Nothing of the server's dependencies is imported before ``main`` has checked they are installed:
the client-only install has this command too, and says what to install instead of a traceback.
Errors a user can fix (a flag, a setting, a port in use, a model path) are one line each on
stderr, exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import importlib.util
import logging
import os
import sys
import typing
from collections.abc import Sequence
from pathlib import Path

from logprob_service import __version__

if typing.TYPE_CHECKING:
    from logprob_service.settings.model import Settings

_MODEL_FLAG_HELP = (
    "NAME=SOURCE of a model to serve; repeat for several. "
    "SOURCE: builtin:tiny-llama, a local HF checkpoint directory, a hub id, or BASE+ADAPTER_DIR: a LoRA model "
    "sharing the weights of the served model BASE, with a PEFT adapter directory "
    "(--model base=/models/Qwen2.5-7B --model tuned=base+/adapters/tuned). "
    "[env LOGPROB_MODELS; default: default=builtin:tiny-llama]"
)
# serve's settings in groups, in the order a newcomer reads them: `serve --help` and
# docs/configuration.md (scripts/gen_config_docs.py) both list them so. The one place a setting's
# group is named; a setting named in no group is listed under the last, "advanced".
SETTING_GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "models": (
        "what to serve, on which devices",
        ("models", "device", "tensor_parallel", "dtype", "fp8_compute", "trust_remote_code"),
    ),
    "network": (
        "ports, connections, shutdown",
        (
            "host",
            "port",
            "http_port",
            "metrics_port",
            "max_message_bytes",
            "http_max_body_bytes",
            "http_max_buffered_body_bytes",
            "http_max_connections",
            "http_header_timeout_s",
            "http_body_timeout_s",
            "http_trusted_proxies",
            "max_connection_age_s",
            "max_concurrent_rpcs_per_connection",
            "grace_period_s",
            "drain_notice_s",
        ),
    ),
    "security": (
        "TLS and tokens (SECURITY.md)",
        ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "auth_tokens_file", "auth_tokens"),
    ),
    "limits": (
        "what one request, and one client, may ask",
        (
            "max_sequences_per_request",
            "max_tokens_per_request",
            "max_answer_bytes",
            "max_stream_answer_bytes",
            "max_queued_tokens",
            "max_queued_tokens_per_client",
        ),
    ),
    "weights": (
        "weight updates (docs/weights.md)",
        (
            "weight_receivers",
            "weight_receiver_port",
            "load_weights_roots",
            "check_finite_weights",
            "update_staging_reserve_bytes",
            "update_idle_timeout_s",
            "update_yield_to_launches",
            "max_group_timeout_s",
            "max_version_wait_s",
        ),
    ),
    "performance": (
        "batching and kernels",
        (
            "max_batch_tokens",
            "max_batch_sequences",
            "max_wait_ms",
            "max_wait_quiet_ms",
            "share_prompts",
            "deterministic",
            "compile_layers",
            "logprob_kernel",
            "attention_backend",
            "long_sequence_tokens",
            "chunk_tokens",
            "lm_head_chunk_bytes",
            "input_embeddings",
        ),
    ),
    "advanced": ("logs and memory", ("log_level", "log_format", "keep_freed_host_memory", "gc_freeze")),
}
# The server extra's packages (pyproject.toml), as the modules they are imported as.
SERVER_MODULES = (
    "torch",
    "transformers",
    "safetensors",
    "grpc_health",
    "grpc_reflection",
    "prometheus_client",
    "pydantic",
    "pydantic_settings",
    "yaml",
    "peft",
    "starlette",
    "uvicorn",
    "orjson",
)
# The exit code of a server whose tensor-parallel group lost a rank (a restart serves again).
EXIT_GROUP_LOST = 3
# argparse's exit code for a bad command line; invalid settings and start-up errors exit with it too.
EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse printed its whole usage before an error: 40 lines for ``serve``, the error last.
    Here: the error, a ``did you mean`` for a mistyped flag, and a one-line usage hint."""

    commands: dict[str, argparse.ArgumentParser]

    def __init__(self, *args: typing.Any, **kwargs: typing.Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands = {}

    def error(self, message: str) -> typing.NoReturn:
        commands = f" {{{','.join(self.commands)}}}" if self.commands else ""
        self.exit(
            EXIT_USAGE,
            f"{self.prog}: error: {message}\nusage: {self.prog}{commands} [flags]; {self.prog} --help lists them\n",
        )

    def unrecognized(self, extra: list[str]) -> typing.NoReturn:
        """Refuse flags this parser does not know, showing the flags only (a value may be a
        secret: ``--auth-tokens TOKEN``) and the known flag each was most likely meant to be."""
        flags = [arg.partition("=")[0] for arg in extra if arg.startswith("-")]
        if not flags:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        from logprob_service.settings.sources import ENV_ONLY_SETTINGS, env_variable

        known = [option for action in self._actions for option in action.option_strings]
        hints = []
        for option in flags:
            name = option.lstrip("-").replace("-", "_")
            if name in ENV_ONLY_SETTINGS:
                hints.append(f"{option} is environment only: set {env_variable(name)}")
            elif guess := difflib.get_close_matches(option, known, n=1):
                hints.append(f"did you mean {guess[0]}?")
        self.error(f"unrecognized arguments: {' '.join(flags)}" + (f" ({'; '.join(hints)})" if hints else ""))


def missing_server_modules() -> list[str]:
    """The modules of the server extra that are not installed."""
    return [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]


def _flag_type(annotation: object) -> tuple[type, list[str] | None]:
    """argparse type and choices for a Settings field's annotation."""
    if typing.get_origin(annotation) is typing.Literal:
        return str, list(typing.get_args(annotation))
    return (annotation if annotation in (int, float, str) else str), None


def grouped_settings(names: typing.Iterable[str]) -> list[tuple[str, str, list[str]]]:
    """(group, title, its settings among ``names``) for each group of SETTING_GROUPS, in order;
    a name no group lists goes to the last group."""
    names = list(names)
    groups = [(group, title, [n for n in members if n in names]) for group, (title, members) in SETTING_GROUPS.items()]
    listed = {n for _, _, members in groups for n in members}
    groups[-1][2].extend(n for n in names if n not in listed)
    return groups


def build_parser() -> _Parser:
    from logprob_service.settings.model import Settings
    from logprob_service.settings.sources import ENV_ONLY_SETTINGS, env_variable, flag

    parser = _Parser(prog="logprob-service", description="Token log-prob scoring service.")
    parser.add_argument("--version", action="version", version=f"logprob-service {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve models over gRPC, and over HTTP with --http-port",
        usage="logprob-service serve [flags]",
        description=(
            "Serve models over gRPC (--port), and over HTTP (the vLLM / SGLang / TRL routes, docs/http.md) when "
            "--http-port is set (default 0: off). Precedence: flags > LOGPROB_* environment > --config file > defaults."
        ),
        argument_default=argparse.SUPPRESS,  # only flags given on the command line override
        # No prefixes: `--auth-tokens SECRET` must not pass as `--auth-tokens-file` (and echo the secret).
        allow_abbrev=False,
    )
    serve.add_argument("--config", help="YAML file of settings (same names as the flags, with _) [env LOGPROB_CONFIG]")
    fields = Settings.model_fields
    for group, title, names in grouped_settings(fields):
        flags = serve.add_argument_group(group, f"{title}.")
        for name in names:
            if name == "models":
                flags.add_argument(
                    "--model", dest="models", action="append", metavar="NAME=SOURCE", help=_MODEL_FLAG_HELP
                )
                continue
            if name in ENV_ONLY_SETTINGS:
                continue
            field = fields[name]
            help_text = (
                f"{field.description} [env {env_variable(name)}; "
                f"default: {field.get_default(call_default_factory=True)}]"
            ).replace("%", "%%")  # argparse formats help with %: a literal "0.3%" broke --help
            if field.annotation is bool:
                flags.add_argument(flag(name), dest=name, action=argparse.BooleanOptionalAction, help=help_text)
            else:
                kind, choices = _flag_type(field.annotation)
                flags.add_argument(flag(name), dest=name, type=kind, choices=choices, help=help_text)
    probe = commands.add_parser(
        "probe",
        help="exit 0 if a server is SERVING (gRPC health check), else 1",
        description=(
            "Ask a server's gRPC health service whether it is SERVING (the container's health check). It reads the "
            "settings `serve` reads (LOGPROB_* environment, LOGPROB_CONFIG): the address, and TLS or mutual TLS."
        ),
    )
    probe.add_argument(
        "--address",
        help="HOST:PORT to ask [default: the host and port that `serve` would use in this environment, "
        "loopback for 0.0.0.0]",
    )
    probe.add_argument("--service", default="", help="service name to ask about [default: '', the whole server]")
    probe.add_argument("--timeout-s", type=float, default=5.0, help="seconds to wait for the answer [default: 5]")
    probe.add_argument(
        "--tls-ca-file",
        type=Path,
        help="with TLS on: PEM CA certificates that signed the server's certificate [default: the server's own "
        "tls_cert_file and tls_client_ca_file, as `serve` reads them]",
    )
    probe.add_argument(
        "--tls-client-cert-file",
        type=Path,
        help="with mutual TLS: the PEM certificate the probe presents [default: the server's tls_cert_file]",
    )
    probe.add_argument(
        "--tls-client-key-file", type=Path, help="its PEM private key [default: the server's tls_key_file]"
    )
    parser.commands = {"serve": serve, "probe": probe}
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The settings of ``serve``'s flags, environment and config file (settings.model.load_settings)."""
    from logprob_service.settings.model import Settings, load_settings

    overrides = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    return load_settings(getattr(args, "config", None), **overrides)


def _print_error(err: BaseException) -> None:
    for line in str(err).splitlines():
        print(f"logprob-service: {line}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if missing := missing_server_modules():
        command = "probe" if "probe" in argv else "serve"
        print(
            f"logprob-service {command} needs the server extra: from a checkout of logprob-service, "
            "pip install '.[server]' (or its wheel: pip install "
            f"'logprob_service-{__version__}-py3-none-any.whl[server]'; docs/deployment.md) "
            f"(not installed: {', '.join(missing)})",
            file=sys.stderr,
        )
        return EXIT_USAGE
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.commands[args.command].unrecognized(extra)
    from logprob_service.settings.errors import StartupError

    try:
        if args.command == "probe":
            from logprob_service.api.probe import main as probe

            return probe(
                args.address,
                args.service,
                args.timeout_s,
                args.tls_ca_file,
                args.tls_client_cert_file,
                args.tls_client_key_file,
            )
        settings = settings_from_args(args)
    except StartupError as err:
        _print_error(err)
        return 1 if args.command == "probe" else EXIT_USAGE  # a health check knows 0 and 1 only
    from logprob_service.logs import configure_logging

    configure_logging(settings.log_level, settings.log_format)
    from logprob_service import host_malloc

    host_malloc.apply(settings.keep_freed_host_memory)  # before any thread starts or any weight arrives
    from logprob_service.builder import GroupLost, ModelLoadError
    from logprob_service.security.bearer_tokens import TokenConfigError
    from logprob_service.startup import serve

    try:
        asyncio.run(serve(settings))
    except GroupLost:
        # Logged; threads may wait forever in a collective with the lost rank, so none is joined.
        logging.shutdown()
        os._exit(EXIT_GROUP_LOST)
    except (StartupError, TokenConfigError) as err:  # a port in use, a bad token document: found before serving
        _print_error(err)
        return EXIT_USAGE
    except ModelLoadError as err:
        logging.getLogger("logprob_service").error("%s", err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
