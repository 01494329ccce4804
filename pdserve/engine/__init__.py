"""The model and the decisions: model slices, the paged KV pool, prefix cache, scheduler, sampling,
loader, tokenizer and the offline Engine. Imports no zmq, fastapi, uvicorn or torch.distributed."""
