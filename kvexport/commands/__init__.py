"""The `kvexport` command line (cli) and what only commands use: describing an artifact, scoring a
request file, filtering AOTInductor's stderr."""
