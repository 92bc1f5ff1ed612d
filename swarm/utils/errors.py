"""The project's root exception, :class:`SwarmError`, and the exit codes its subclasses carry.

Every error the project raises on purpose derives from :class:`SwarmError` and says, as ``exit_code``, how a
command ends on it (the table in docs/OPERATIONS.md). The command-line layer (:mod:`swarm.cli.options`) therefore
imports this one class, not an exception of each package. Subclasses keep a builtin base where callers catch one
(a :class:`~swarm.utils.settings.SettingError` is still a ``ValueError``).
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_NOT_SERVED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_IN_USE = 4
EXIT_HALTED = 5
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130


class SwarmError(Exception):
    """An error of this project; ``exit_code`` is how a command ends on it.

    :data:`EXIT_INTERNAL` (the default) means the command has no advice to give beyond the message: it is
    reported as an unexpected error.
    """

    exit_code: int = EXIT_INTERNAL
