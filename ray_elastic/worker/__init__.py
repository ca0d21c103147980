"""The worker: one actor process per host, running its slice's part of each
step. `actor.SliceWorker` is the actor; beside it, by concern: set-up
(setup), the compile cache of the hosts JAX's own misses (host_cache), the
held state (state), the step's math (steps), snapshots, copies
and loads (transfer), sharded checkpoint writes (checkpoints), the SIGTERM
notice (notices), exchange counters (exchange_stats), and what a step needs
on the way: its inputs (inputs), the ordered gradient sum (reduction), a
host's own blocks of sharded arrays (shards)."""
