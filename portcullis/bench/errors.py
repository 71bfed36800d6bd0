"""The one error the command shows as a line and exit code 1: something the user can fix."""


class BenchError(Exception):
    pass
