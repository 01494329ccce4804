"""One PP rank's process: the slot loop, PP comm between ranks, idle waits and span records."""
