"""What a host loads and runs: a built package (package), its request contract (requests), the step
program and its CUDA graphs (step_runner, program), and reading a package file without loading it
(package_file). Nothing here builds native code or exports a model."""
