"""Dispatch: how one training step is carried out on the live slices. The
pure plan (which shards each slice computes, the reduction tree), the calls
and their deadlines, the driver's step runner, and the group leaders that make
the calls of many slices for the driver."""
