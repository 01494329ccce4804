"""The node runtime: PP comm, the slot loop, rank processes, the node front, its HTTP app and
metrics, process launch and core placement. Built on engine/ (the model and the decisions)."""
