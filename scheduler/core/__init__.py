"""The scheduling core every backend shares: the round planner (planner), the regular/irregular
partitions around a policy (partition) and cluster capacities (cluster). Pure: no I/O but
reading a cluster file."""
