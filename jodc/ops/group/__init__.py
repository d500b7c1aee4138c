"""The group ops: gather, scatter-accumulate and barrier among a group of devices named at run time (an int32 member
list operand, so one compiled program serves every grouping: context parallelism's groups are chosen per
minibatch). One op per module, as the world-wide ops at the package root; `members` checks the lists. `exchange`
builds context parallelism's K/V exchange on them (`OdcGroupExchange`, `ExchangeSlots`; imported from there, not
re-exported here)."""
from jodc.ops.group.barrier import group_barrier
from jodc.ops.group.gather import group_gather
from jodc.ops.group.scatter_accumulate import group_scatter_accumulate

__all__ = ["group_barrier", "group_gather", "group_scatter_accumulate"]
