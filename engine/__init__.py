"""The core shared by both node types: model slices, paged KV, prefix cache, scheduler, PP loop."""
