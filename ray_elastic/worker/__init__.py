"""The worker: one actor process per host, running its slice's part of each
step (set-up, step math, state transfer, checkpoint writes), and what it
needs on the way (its inputs, the ordered gradient sum, its shards)."""
