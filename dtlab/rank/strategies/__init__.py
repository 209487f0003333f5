"""One module per strategy, each with `train(cfg, run_dir, rank, world, writer)`, run inside a rank; which module a
strategy uses and what it supports is its spec in dtlab.config.strategies."""
