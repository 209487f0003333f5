"""What runs inside a rank process (started by torchrun): the lifecycle, process-group setup, model and data,
the recorders, and one module per strategy (ddp, zero3). Nothing here is imported by the notebook kernel."""
