"""waltz_server: the Waltz server, storage node, lock tables and the `waltz` CLI."""
