"""The `kvexport` command line: the group (cli), one module per command group, the parameter types
(params), the arguments several commands share (arguments), how a command ends (interrupts), and
what only commands use: describing an artifact, scoring a request file, filtering AOTInductor's
stderr."""
