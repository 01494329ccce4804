"""What the prefill and decode nodes share: the PD loop base over the consensus ring."""
