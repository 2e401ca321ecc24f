"""The one exception type for errors a user can cause."""


class JmarlError(Exception):
    """A user-caused error (config, paths, unsupported architecture, malformed data).

    The message names the offending thing and how to fix it; the CLI prints it without a
    traceback and exits with status 2.
    """
