"""Control: the controller loop in the Ray driver, its run states, the pure
recovery policy, slice membership, pipelining and preemption notices."""
