"""The `cafa` command line: parses options, calls one job per command, and maps errors
to one line on stderr and an exit code."""
