"""One module per strategy, each with its dtlab.rank.loop.Strategy class, run inside a rank by the one training loop;
which module and class a strategy uses and what it supports is its spec in dtlab.config.strategies."""
