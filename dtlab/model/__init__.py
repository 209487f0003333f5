"""The pure model of communication: alpha-beta cost forms, DDP's bucket layout and queue, fitting a machine
profile, what-if predictions, and replaying measured runs against a profile. No torch, no widgets."""
