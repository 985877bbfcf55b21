"""The Waltz server: partitions, store sessions, recovery, the client-facing endpoint."""
