"""``StartupError``: the server cannot start as configured.

Raised before anything serves by whatever finds the problem: the settings (``model.load_settings``),
and the ports each edge and the metrics server bind. Each names the setting to fix as the user
wrote it, so the CLI prints the message alone and exits 2.
"""

from __future__ import annotations


class StartupError(Exception):
    """The server cannot start as configured. Each line of the message is one problem, naming the
    flag, environment variable or file to fix; the CLI prints them alone and exits 2."""
