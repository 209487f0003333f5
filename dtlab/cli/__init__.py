"""The `dtlab` command line: `main` (run, show, trace, calibrate, assign, grade), `nodes` (slurm, emulate), `flags`
(flags generated from the config dataclasses, same names, defaults and help) and `doctor`."""
