"""In-memory reference implementations of the four contracts (plugins named ``memory``)."""
