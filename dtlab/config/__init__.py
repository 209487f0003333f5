"""What a job is, decided before any process starts: pure dataclasses and checks, no torch.distributed.

- `run`: RunConfig (a training run) and ZeroConfig; `calibration`: CalibConfig (a collective sweep); `job`: the
  launch fields both share (backend, output folder, time limit, nodes and rendezvous);
- `strategies`: one spec per strategy (its rank module and what it supports), read by every check;
- `options`: RunConfig's option groups (what one strategy or lever reads) and the one table of their flat names;
- `validate`: field validators that name the field and what is allowed; `placement`: where ranks run on this machine;
- one module per lever or fault tool it validates, with the same stem in every layer it touches: `compression`
  (and accumulation), `stragglers`, `restarts`, `nodes`; `datafile` and `models`: the data files and models a
  run may name.
"""
