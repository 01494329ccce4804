"""pdserve: the command line and the local cluster launcher."""
