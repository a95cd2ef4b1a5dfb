"""The server's settings: one pydantic-settings model, where its values come from, and the error
that stops a start.

Precedence, lowest first: defaults < YAML config file < environment (``LOGPROB_*``) < CLI flags.
Every setting is one flat field, so it has one flag, one variable and one file key.

The rooms: ``model`` (``Settings``, and ``load_settings``, which reads it as the CLI does),
``weight_updates`` (the group of fields that says how weight updates are received, checked and
staged, which ``Settings`` takes in), ``sources`` (the variables, the config file, the flags, how a
problem names the setting as the user wrote it, the ``NAME=SOURCE`` model specs), ``errors``
(``StartupError``). Like the other common modules, nothing here imports a layer.
"""
