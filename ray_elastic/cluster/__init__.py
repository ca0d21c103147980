"""The cluster: what the controller asks of it (backend), and Ray behind
that interface: slices as placement groups of worker actors, warm pools,
drain notices, and the local multi-node clusters of the demo and tests."""
