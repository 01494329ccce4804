"""The prefill node's event loop and queues: bootstrap, waiting, running, inflight."""
