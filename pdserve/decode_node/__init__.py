"""The decode node's event loop and queues: prealloc, transfer, running, retracted."""
