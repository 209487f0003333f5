"""What runs inside a rank process started by torchrun: `worker` (the entry point), `lifecycle` (logs, events,
errors, process-group setup and teardown), `data` (model, tokenizer, sentences), `recorder` and `marks` (how
buckets and steps are timed), `restarts` (checkpoints), `compression`, `calibration` (the collective sweep's rank
side), `harness` (the build-it-yourself exercises' rank side) and `strategies/` (one module per strategy; their two
bases, with the injected straggler delay, in `strategies.bases`). The notebook kernel never imports this package
(the import contracts in pyproject.toml hold that).
"""
